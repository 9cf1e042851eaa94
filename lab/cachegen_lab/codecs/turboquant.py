"""TurboQuant (ICLR 2026; a vLLM KV-cache dtype) as a codec: ``turboquant``.

Calibration-free: every head's key or value vector ``x`` (``head_dim`` channels) is rotated
by a random Hadamard transform ``R = H diag(s)`` (random signs ``s`` from a seed derived from
the model's fingerprint, the layer and K/V, so the decoder derives the same), divided by its
norm and scaled by ``sqrt(head_dim)``; its coordinates are then close to N(0, 1) whatever the
input, and each is coded with the Gaussian Lloyd-Max quantizer
(:func:`~cachegen.codec.transform.lloyd_max.lloyd_max`). The norm is stored per (token, head)
in fp16.

Levels are tenths of a bit per coordinate: ``25`` (2.5 bits) and ``35`` (3.5 bits). A
fractional rate mixes two quantizers: after the rotation all coordinates are alike, so the
first half of the rotated coordinates gets the higher width and the second half the lower
(2.5 = half at 3 bits and half at 2; 3.5 = half at 4 and half at 3). This is the simple split
the paper's outlier-channel scheme reduces to once the rotation has spread the outliers. The
norm adds ``16 / head_dim`` bits per element.

Frame body (fixed size)::

    norms   fp16 [2, L, H, n] (keys then values)
    codes   for the high-width half, then the low-width half: the codes of [2, L, H, n,
            head_dim / 2] packed at that width, little-endian bit order

``head_dim`` must be a power of two (the Hadamard transform's order).
"""

from __future__ import annotations

import functools
import hashlib
import math

import numpy as np
import torch

from cachegen.codec.base import Codec, FrameDecoder, check_size, kv_tensor
from cachegen.codec.cachegen.quant import FP16_MAX, hadamard
from cachegen.codec.coding.bitstream import Frame, Header
from cachegen.codec.errors import CodecError
from cachegen.codec.transform.lloyd_max import dequantize, quantize
from cachegen.codec.transform.packing import pack_bits, packed_size, unpack_bits
from cachegen.kv import KVCache

# level -> (bits of the first half of the rotated coordinates, bits of the second half)
LEVELS = {25: (3, 2), 35: (4, 3)}
DEFAULT_LEVEL = 35


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise CodecError(
            f"turboquant needs a power-of-two head_dim for its Hadamard rotation, got {head_dim}"
        )


@functools.lru_cache(maxsize=256)
def rotation_signs(fingerprint: str, layer: int, kind: int, head_dim: int) -> torch.Tensor:
    """The random signs of (model, layer, K/V): derived from a hash, the same everywhere."""
    digest = hashlib.sha256(f"turboquant/{fingerprint}/{layer}/{kind}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return torch.from_numpy(rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=head_dim))


def _signs(fingerprint: str, layers: tuple[int, ...], head_dim: int) -> torch.Tensor:
    """Signs [2, L, 1, 1, D] of the layers held."""
    return torch.stack(
        [
            torch.stack([rotation_signs(fingerprint, layer, k, head_dim) for layer in layers])
            for k in range(2)
        ]
    ).view(2, len(layers), 1, 1, head_dim)


def _column_bits(level: int, head_dim: int) -> np.ndarray:
    high, low = LEVELS[level]
    half = head_dim // 2
    return np.array([high] * half + [low] * (head_dim - half), dtype=np.uint8)


class TurboQuantCodec(Codec):
    name = "turboquant"
    codec_id = 11

    @property
    def levels(self) -> list[int]:
        return sorted(LEVELS)

    @property
    def default_level(self) -> int:
        return DEFAULT_LEVEL

    def encode(self, kv: KVCache, level: int | None = None) -> bytes:
        _check_head_dim(kv.head_dim)
        return super().encode(kv, level)

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        x = kv_tensor(chunk).to(torch.float32)
        D = x.shape[-1]
        rotated = hadamard(x * _signs(chunk.model.fingerprint, chunk.layer_indices, D))
        norms = x.norm(dim=-1, keepdim=True).clamp(max=FP16_MAX).to(torch.float16)
        n = norms.float()
        y = torch.where(n > 0, rotated * (math.sqrt(D) / n), torch.zeros_like(rotated))
        bits = _column_bits(level, D)
        codes = quantize(y, bits)
        half = D // 2
        return b"".join(
            [
                norms.numpy().tobytes(),
                pack_bits(codes[..., :half], int(bits[0])),
                pack_bits(codes[..., half:], int(bits[-1])),
            ]
        )

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        if header.params:
            raise CodecError("turboquant bitstream header is corrupt (parameters)")
        if header.level not in LEVELS:
            raise CodecError(
                f"turboquant bitstream header is corrupt (level {header.level}; levels are "
                f"{sorted(LEVELS)})"
            )
        _check_head_dim(header.head_dim)
        return TurboQuantDecoder(header)


class TurboQuantDecoder(FrameDecoder):
    def __init__(self, header: Header) -> None:
        super().__init__(header)
        self.bits = _column_bits(header.level, header.head_dim)

    def _sizes(self, n: int) -> tuple[int, int, int]:
        h = self.header
        vectors = 2 * h.num_layers * h.num_kv_heads * n
        half = h.head_dim // 2
        return (
            2 * vectors,
            packed_size(vectors * half, int(self.bits[0])),
            packed_size(vectors * (h.head_dim - half), int(self.bits[-1])),
        )

    def check(self, frame: Frame) -> None:
        check_size(frame, sum(self._sizes(len(frame.token_ids))), "turboquant")

    def decode_frame(self, frame: Frame, out: torch.Tensor, token_offset: int) -> None:
        h = self.header
        n = len(frame.token_ids)
        L, H, D = h.num_layers, h.num_kv_heads, h.head_dim
        half = D // 2
        a, b, _ = self._sizes(n)
        body = frame.body
        norms = torch.from_numpy(np.frombuffer(body[:a], dtype="<f2").astype(np.float32))
        vectors = 2 * L * H * n
        high = unpack_bits(body[a : a + b], int(self.bits[0]), vectors * half)
        low = unpack_bits(body[a + b :], int(self.bits[-1]), vectors * (D - half))
        codes = torch.cat([high.view(vectors, half), low.view(vectors, D - half)], dim=1)
        y = dequantize(codes, self.bits).view(2, L, H, n, D)
        signs = _signs(h.model.fingerprint, h.layer_indices, D)
        x = hadamard(y) * signs * (norms.view(2, L, H, n, 1) / math.sqrt(D))
        out[:, :, :, token_offset : token_offset + n] = x

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        L = self.header.num_layers
        return np.full((L, 2), len(frame.body) / (2 * L))
