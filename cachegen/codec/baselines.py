"""Baseline codecs in the same bitstream: raw, int8, fp8, int8 + zstd and KIVI-style 2-bit.

All bodies are fixed-size given the header (except int8-zstd, whose decompressed size is),
so decoders check sizes exactly before touching the data.

* ``raw``: the KV bytes in their own dtype (bf16/fp16/fp32), lossless.
* ``int8``: symmetric int8 with one fp16 scale per (layer, token) over all heads: the
  CacheGen paper's "default quantization" baseline.
* ``fp8``: float8 e4m3 (vLLM's fp8 KV dtype) with one float32 scale per (layer, K/V) per chunk.
* ``int8-zstd``: the int8 body compressed by zstd (what an earlier reproduction shipped).
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

from cachegen.codec.base import Codec, FrameDecoder, check_size, kv_tensor
from cachegen.codec.bitstream import Frame, Header
from cachegen.codec.errors import CodecError
from cachegen.codec.quant import FP16_MAX
from cachegen.kv import KVCache

_NUMPY_OF = {torch.float16: "<f2", torch.bfloat16: "<u2", torch.float32: "<f4"}


def _as_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _from_bytes(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.from_numpy(np.frombuffer(data, dtype=_NUMPY_OF[dtype]).copy())
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.view(shape)


def _fp16_bytes(t: torch.Tensor) -> bytes:
    return t.to(torch.float16).contiguous().numpy().tobytes()


def _fp16(data: memoryview, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype="<f2").astype(np.float32)).view(shape)


class _Decoder(FrameDecoder):
    """Fixed-layout decoders: ``body_size(n)`` and ``decode_body(body, n) -> [2,L,H,n,D] float``."""

    codec_name = ""

    def body_size(self, n: int) -> int:
        raise NotImplementedError

    def decode_body(self, body: memoryview, n: int) -> torch.Tensor:
        raise NotImplementedError

    def check(self, frame: Frame) -> None:
        check_size(frame, self.body_size(len(frame.token_ids)), self.codec_name)

    def decode_frame(self, frame: Frame, out: torch.Tensor, token_offset: int) -> None:
        n = len(frame.token_ids)
        out[:, :, :, token_offset : token_offset + n] = self.decode_body(frame.body, n)

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        L = self.header.num_layers
        return np.full((L, 2), len(frame.body) / (2 * L))

    @property
    def elements_per_token(self) -> int:
        h = self.header
        return h.num_layers * h.num_kv_heads * h.head_dim


# ---- raw ------------------------------------------------------------------------------------


class RawCodec(Codec):
    name = "raw"
    codec_id = 1
    lossless = True

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        return _as_bytes(kv_tensor(chunk))

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        return _RawDecoder(header)


class _RawDecoder(_Decoder):
    codec_name = "raw"

    def body_size(self, n: int) -> int:
        return 2 * self.elements_per_token * n * torch.finfo(self.header.dtype).bits // 8

    def decode_body(self, body: memoryview, n: int) -> torch.Tensor:
        h = self.header
        return _from_bytes(body, h.dtype, (2, h.num_layers, h.num_kv_heads, n, h.head_dim))


# ---- int8 -----------------------------------------------------------------------------------


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [2, L, H, n, D] -> (int8 codes, fp16 per-(K/V, layer, token) absolute maxima)."""
    amax = (
        x.abs()
        .amax(dim=(2, 4), keepdim=True)
        .clamp(max=FP16_MAX)
        .to(torch.float16)
        .to(torch.float32)
    )
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    return q, amax


def _int8_body(chunk: KVCache) -> bytes:
    q, amax = int8_quantize(kv_tensor(chunk).to(torch.float32))
    return _fp16_bytes(amax.reshape(-1)) + q.numpy().tobytes()


class Int8Codec(Codec):
    name = "int8"
    codec_id = 2

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        return _int8_body(chunk)

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        return _Int8Decoder(header)


class _Int8Decoder(_Decoder):
    codec_name = "int8"

    def body_size(self, n: int) -> int:
        return 2 * self.header.num_layers * n * 2 + 2 * self.elements_per_token * n

    def decode_body(self, body: memoryview, n: int) -> torch.Tensor:
        h = self.header
        ns = 2 * h.num_layers * n * 2
        amax = _fp16(body[:ns], (2, h.num_layers, 1, n, 1))
        q = torch.from_numpy(np.frombuffer(body[ns:], dtype=np.int8).copy()).view(
            2, h.num_layers, h.num_kv_heads, n, h.head_dim
        )
        return q.to(torch.float32) * (amax / 127.0)


# ---- int8 + zstd ----------------------------------------------------------------------------


class Int8ZstdCodec(Codec):
    name = "int8-zstd"
    codec_id = 4

    def __init__(self, chunk_tokens: int = 256, zstd_level: int = 3) -> None:
        super().__init__(chunk_tokens)
        self.zstd_level = int(zstd_level)

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        return zstandard.ZstdCompressor(level=self.zstd_level, write_content_size=True).compress(
            _int8_body(chunk)
        )

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        return _Int8ZstdDecoder(header)


class _Int8ZstdDecoder(_Int8Decoder):
    codec_name = "int8-zstd"

    def check(self, frame: Frame) -> None:
        expected = self.body_size(len(frame.token_ids))
        try:
            size = zstandard.frame_content_size(bytes(frame.body[:18]))
        except zstandard.ZstdError as exc:
            raise CodecError(f"frame {frame.index} is corrupt: not a zstd frame ({exc})") from exc
        if size != expected:
            raise CodecError(
                f"frame {frame.index} is corrupt: zstd content is {size} bytes, expected {expected}"
            )

    def decode_frame(self, frame: Frame, out: torch.Tensor, token_offset: int) -> None:
        n = len(frame.token_ids)
        expected = self.body_size(n)
        try:
            raw = zstandard.ZstdDecompressor().decompress(
                bytes(frame.body), max_output_size=expected
            )
        except zstandard.ZstdError as exc:
            raise CodecError(f"frame {frame.index} is corrupt: zstd says {exc}") from exc
        if len(raw) != expected:
            raise CodecError(
                f"frame {frame.index} is corrupt: zstd content is {len(raw)} bytes, "
                f"expected {expected}"
            )
        out[:, :, :, token_offset : token_offset + n] = self.decode_body(memoryview(raw), n)


# ---- fp8 ------------------------------------------------------------------------------------

FP8_MAX = 448.0


class Fp8Codec(Codec):
    name = "fp8"
    codec_id = 3

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        x = kv_tensor(chunk).to(torch.float32)
        amax = x.abs().amax(dim=(2, 3, 4), keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (
            scale.reshape(-1).numpy().astype("<f4").tobytes()
            + q.view(torch.uint8).numpy().tobytes()
        )

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        return _Fp8Decoder(header)


class _Fp8Decoder(_Decoder):
    codec_name = "fp8"

    def body_size(self, n: int) -> int:
        return 2 * self.header.num_layers * 4 + 2 * self.elements_per_token * n

    def decode_body(self, body: memoryview, n: int) -> torch.Tensor:
        h = self.header
        ns = 2 * h.num_layers * 4
        scale = torch.from_numpy(np.frombuffer(body[:ns], dtype="<f4").copy()).view(
            2, h.num_layers, 1, 1, 1
        )
        q = torch.from_numpy(np.frombuffer(body[ns:], dtype=np.uint8).copy()).view(
            torch.float8_e4m3fn
        )
        return q.to(torch.float32).view(2, h.num_layers, h.num_kv_heads, n, h.head_dim) * scale


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

    def __init__(self, chunk_tokens: int = 256, group_size: int = 32) -> None:
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
                _fp16_bytes(kmin),
                _fp16_bytes(kstep),
                _fp16_bytes(vmin),
                _fp16_bytes(vstep),
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


class _Kivi2Decoder(_Decoder):
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
            fields.append(_fp16(body[pos : pos + 2 * count], (count,)))
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
