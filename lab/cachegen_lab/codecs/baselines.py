"""Research baselines in the core's bitstream: int8 + zstd and KIVI-style 2-bit.

* ``int8-zstd``: the ``int8`` body compressed by zstd (what an earlier reproduction shipped);
  its decompressed size is fixed by the header, so it is checked before inflating.
* ``kivi2``: KIVI's 2-bit asymmetric quantization: keys per channel over groups of
  ``group_size`` tokens, values per token over groups of ``group_size`` channels of a
  head; fp16 minimum and step per group. (KIVI's full-precision window of recent tokens
  is a serving-time detail and is left out: here every token is quantized.)
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import zstandard

from cachegen.codec.base import Codec, FrameDecoder
from cachegen.codec.baselines import (
    FixedLayoutCodec,
    FixedLayoutDecoder,
    Int8Decoder,
    fp16_bytes,
    fp16_values,
    int8_body,
)
from cachegen.codec.cachegen.quant import FP16_MAX
from cachegen.codec.coding.bitstream import Frame, Header
from cachegen.codec.errors import CodecError
from cachegen.constants import CHUNK_TOKENS
from cachegen.kv import KVCache

# ---- int8 + zstd ----------------------------------------------------------------------------


def _check_content_size(frame: Frame, size: int | None, expected: int) -> None:
    if size != expected:
        raise CodecError(
            f"frame {frame.index} is corrupt: zstd content is {size} bytes, expected {expected}"
        )


class _Int8ZstdDecoder(Int8Decoder):
    codec_name = "int8-zstd"

    def check(self, frame: Frame) -> None:
        try:
            size = zstandard.frame_content_size(bytes(frame.body[:18]))
        except zstandard.ZstdError as exc:
            raise CodecError(f"frame {frame.index} is corrupt: not a zstd frame ({exc})") from exc
        _check_content_size(frame, size, self.body_size(len(frame.token_ids)))

    def decode_frame(self, frame: Frame, out: torch.Tensor, token_offset: int) -> None:
        n = len(frame.token_ids)
        expected = self.body_size(n)
        try:
            raw = zstandard.ZstdDecompressor().decompress(
                bytes(frame.body), max_output_size=expected
            )
        except zstandard.ZstdError as exc:
            raise CodecError(f"frame {frame.index} is corrupt: zstd says {exc}") from exc
        _check_content_size(frame, len(raw), expected)
        out[:, :, :, token_offset : token_offset + n] = self.decode_body(memoryview(raw), n)


class Int8ZstdCodec(FixedLayoutCodec):
    name = "int8-zstd"
    codec_id = 4
    decoder_class = _Int8ZstdDecoder

    def __init__(self, chunk_tokens: int = CHUNK_TOKENS, zstd_level: int = 3) -> None:
        super().__init__(chunk_tokens)
        self.zstd_level = int(zstd_level)

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        return zstandard.ZstdCompressor(level=self.zstd_level, write_content_size=True).compress(
            int8_body(chunk)
        )


# ---- KIVI 2-bit -----------------------------------------------------------------------------


def _pack2(codes: torch.Tensor) -> bytes:
    flat = codes.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat([flat, torch.zeros(pad, dtype=torch.uint8)])
    q = flat.view(-1, 4)
    return (q[:, 0] | q[:, 1] << 2 | q[:, 2] << 4 | q[:, 3] << 6).numpy().tobytes()


def _unpack2(data: memoryview, count: int) -> torch.Tensor:
    b = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    return torch.stack([b & 3, b >> 2 & 3, b >> 4 & 3, b >> 6 & 3], dim=1).reshape(-1)[:count]


def _minmax_quant(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2-bit asymmetric quantization of ``x`` with groups along ``dim``: codes, fp16 min,
    fp16 step."""
    mn = x.amin(dim=dim, keepdim=True).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    mx = x.amax(dim=dim, keepdim=True)
    step = ((mx - mn.float()) / 3).clamp(max=FP16_MAX).to(torch.float16)
    s = step.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    codes = torch.round((x - mn.float()) * inv).clamp_(0, 3)
    return codes, mn, step


class Kivi2Codec(Codec):
    name = "kivi2"
    codec_id = 5

    def __init__(self, chunk_tokens: int = CHUNK_TOKENS, group_size: int = 32) -> None:
        super().__init__(chunk_tokens)
        if not 1 <= int(group_size) <= 0xFFFF:
            raise CodecError(f"group_size must be in 1..65535, got {group_size}")
        self.group_size = int(group_size)

    def params(self, kv: KVCache, level: int) -> bytes:
        return struct.pack("<H", self.group_size)

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        g = self.group_size
        L, H, n, D = chunk.keys.shape
        ng, gv = -(-n // g), _value_group(D, g)
        k = chunk.keys.to(torch.float32).cpu()
        if ng * g != n:  # repeat the last token: padding must not change any group's min/max
            k = torch.cat([k, k[:, :, -1:].expand(L, H, ng * g - n, D)], dim=2)
        kc, kmin, kstep = _minmax_quant(k.view(L, H, ng, g, D), dim=3)
        kc = kc.view(L, H, ng * g, D)[:, :, :n]
        vc, vmin, vstep = _minmax_quant(
            chunk.values.to(torch.float32).cpu().reshape(L, H, n, D // gv, gv), dim=4
        )
        return b"".join(
            [
                fp16_bytes(kmin),
                fp16_bytes(kstep),
                fp16_bytes(vmin),
                fp16_bytes(vstep),
                _pack2(kc),
                _pack2(vc),
            ]
        )

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        if len(header.params) != 2:
            raise CodecError("kivi2 bitstream header is corrupt (parameters)")
        (group,) = struct.unpack("<H", header.params)
        if group == 0:
            raise CodecError("kivi2 bitstream header is corrupt (group size 0)")
        return _Kivi2Decoder(header, group)


def _value_group(head_dim: int, group: int) -> int:
    return group if head_dim % group == 0 else head_dim


class _Kivi2Decoder(FixedLayoutDecoder):
    codec_name = "kivi2"

    def __init__(self, header: Header, group: int) -> None:
        super().__init__(header)
        self.group = group

    def _sizes(self, n: int) -> tuple[int, int, int, int]:
        h = self.header
        L, H, D = h.num_layers, h.num_kv_heads, h.head_dim
        k_params = L * H * -(-n // self.group) * D
        v_params = L * H * n * (D // _value_group(D, self.group))
        codes = -(-(L * H * n * D) // 4)
        return k_params, v_params, codes, 2 * 2 * (k_params + v_params) + 2 * codes

    def body_size(self, n: int) -> int:
        return self._sizes(n)[3]

    def decode_body(self, body: memoryview, n: int) -> torch.Tensor:
        h = self.header
        L, H, D, g = h.num_layers, h.num_kv_heads, h.head_dim, self.group
        kp, vp, nc, _ = self._sizes(n)
        ng, gv = -(-n // g), _value_group(D, g)
        pos = 0
        fields = []
        for count in (kp, kp, vp, vp):
            fields.append(fp16_values(body[pos : pos + 2 * count], (count,)))
            pos += 2 * count
        kc = _unpack2(body[pos : pos + nc], L * H * n * D).to(torch.float32).view(L, H, n, D)
        vc = (
            _unpack2(body[pos + nc : pos + 2 * nc], L * H * n * D)
            .to(torch.float32)
            .view(L, H, n, D // gv, gv)
        )
        token_group = torch.arange(n) // g
        kmin, kstep = (f.view(L, H, ng, D)[:, :, token_group] for f in fields[:2])
        vmin, vstep = (f.view(L, H, n, D // gv, 1) for f in fields[2:])
        return torch.stack([kc * kstep + kmin, (vc * vstep + vmin).view(L, H, n, D)])
