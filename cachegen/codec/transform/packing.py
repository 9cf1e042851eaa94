"""Packing a frame's codes into bytes: fixed-width bit codes (:func:`pack_bits`, little-endian
bit order) and DEFLATE side data read back to an exact size (:func:`inflate_exactly`)."""

from __future__ import annotations

import zlib

import numpy as np
import torch

from cachegen.codec.errors import CodecError


def pack_bits(codes: torch.Tensor, bits: int) -> bytes:
    """Codes (uint8, each below ``2**bits``) packed ``bits`` bits each, little-endian."""
    flat = codes.reshape(-1).numpy()
    planes = (flat[:, None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def unpack_bits(data: memoryview | bytes, bits: int, count: int) -> torch.Tensor:
    """``count`` codes of ``bits`` bits from :func:`pack_bits`'s bytes."""
    planes = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    planes = planes[: count * bits].reshape(count, bits)
    codes = (planes << np.arange(bits, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)
    return torch.from_numpy(codes)


def packed_size(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def inflate_exactly(data: bytes, size: int, bad: str, wrong_size: str) -> bytes:
    """``data`` inflated by zlib, which must give exactly ``size`` bytes, end its stream and
    leave nothing after it. At most ``size + 1`` bytes are ever inflated, so a zlib bomb costs
    nothing. ``CodecError``: ``bad`` (with zlib's reason) for data that does not inflate,
    ``wrong_size`` otherwise."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, size + 1)
    except zlib.error as exc:
        raise CodecError(f"{bad} ({exc})") from exc
    if len(raw) != size or not inflater.eof or inflater.unused_data:
        raise CodecError(wrong_size)
    return raw
