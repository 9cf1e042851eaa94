"""Baseline codecs in the same bitstream: raw, int8 and fp8.

Every body is fixed-size given the header, so decoders check sizes exactly before touching
the data.

* ``raw``: the KV bytes in their own dtype (bf16/fp16/fp32), lossless.
* ``int8``: symmetric int8 with one fp16 scale per (layer, token) over all heads: the
  CacheGen paper's "default quantization" baseline.
* ``fp8``: float8 e4m3 (vLLM's fp8 KV dtype) with one float32 scale per (layer, K/V) per chunk.

The research baselines (``int8-zstd``, ``kivi2``) build on these in
``cachegen_lab.codecs.baselines``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from cachegen.codec.base import Codec, FrameDecoder, check_size, kv_tensor
from cachegen.codec.cachegen.quant import FP16_MAX
from cachegen.codec.coding.bitstream import Frame, Header
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


def fp16_bytes(t: torch.Tensor) -> bytes:
    return t.to(torch.float16).contiguous().numpy().tobytes()


def fp16_values(data: memoryview, shape: tuple[int, ...]) -> torch.Tensor:
    """Little-endian fp16 ``data`` as a float32 tensor of ``shape``."""
    return torch.from_numpy(np.frombuffer(data, dtype="<f2").astype(np.float32)).view(shape)


class FixedLayoutDecoder(FrameDecoder):
    """Decoders whose body size the header fixes: ``body_size(n)`` and ``decode_body(body, n)
    -> [2, L, H, n, D] float``; a body's bytes are shared evenly by its layers."""

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


class FixedLayoutCodec(Codec):
    """A codec whose frames its ``decoder_class`` reads from the header alone."""

    decoder_class: ClassVar[type[FixedLayoutDecoder]]
    element_bits: ClassVar[int]  # bits of one key or value element's code (bf16 KV for raw)

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        return cls.decoder_class(header)

    def estimated_bits(self, level: int | None, chunk_tokens: int, form: str = "coded") -> float:
        """Bits per element of a record: its elements' code (the scales, header and token ids
        left out: they are a small share of a chunk)."""
        return float(self.element_bits)


# ---- raw ------------------------------------------------------------------------------------


class _RawDecoder(FixedLayoutDecoder):
    codec_name = "raw"

    def body_size(self, n: int) -> int:
        return 2 * self.elements_per_token * n * torch.finfo(self.header.dtype).bits // 8

    def decode_body(self, body: memoryview, n: int) -> torch.Tensor:
        h = self.header
        return _from_bytes(body, h.dtype, (2, h.num_layers, h.num_kv_heads, n, h.head_dim))


class RawCodec(FixedLayoutCodec):
    name = "raw"
    codec_id = 1
    lossless = True
    decoder_class = _RawDecoder
    element_bits = 16

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        return _as_bytes(kv_tensor(chunk))


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


def int8_body(chunk: KVCache) -> bytes:
    """The ``int8`` codec's frame body of ``chunk``: the maxima, then the codes."""
    q, amax = int8_quantize(kv_tensor(chunk).to(torch.float32))
    return fp16_bytes(amax.reshape(-1)) + q.numpy().tobytes()


class Int8Decoder(FixedLayoutDecoder):
    codec_name = "int8"

    def body_size(self, n: int) -> int:
        return 2 * self.header.num_layers * n * 2 + 2 * self.elements_per_token * n

    def decode_body(self, body: memoryview, n: int) -> torch.Tensor:
        h = self.header
        ns = 2 * h.num_layers * n * 2
        amax = fp16_values(body[:ns], (2, h.num_layers, 1, n, 1))
        q = torch.from_numpy(np.frombuffer(body[ns:], dtype=np.int8).copy()).view(
            2, h.num_layers, h.num_kv_heads, n, h.head_dim
        )
        return q.to(torch.float32) * (amax / 127.0)


class Int8Codec(FixedLayoutCodec):
    name = "int8"
    codec_id = 2
    decoder_class = Int8Decoder
    element_bits = 8

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        return int8_body(chunk)


# ---- fp8 ------------------------------------------------------------------------------------

FP8_MAX = 448.0


class _Fp8Decoder(FixedLayoutDecoder):
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


class Fp8Codec(FixedLayoutCodec):
    name = "fp8"
    codec_id = 3
    decoder_class = _Fp8Decoder
    element_bits = 8

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        x = kv_tensor(chunk).to(torch.float32)
        amax = x.abs().amax(dim=(2, 3, 4), keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (
            scale.reshape(-1).numpy().astype("<f4").tobytes()
            + q.view(torch.uint8).numpy().tobytes()
        )
