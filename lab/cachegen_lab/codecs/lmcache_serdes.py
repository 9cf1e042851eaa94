"""LMCache's v1 distributed serdes that run on the CPU (``lmcache==0.5.6``) as peer codecs:
``lmcache-fp8`` and ``lmcache-asym-k16-v8``.

LMCache's L2 storage runs a serde on each chunk before storing it
(``lmcache.v1.distributed.serde``): a ``Serializer`` writes a memory object of KV into a byte
buffer sized by its ``estimate_serialized_size``, which LMCache's async processor then narrows
to the bytes written (``set_used_size``); a ``Deserializer`` reads those bytes back into a KV
memory object. This module calls those classes, unchanged, on LMCache's own memory objects
(``lmcache.v1.memory_management.TensorMemoryObj`` over the chunk's tensor, without an
allocator); the only glue is building those objects and laying our KV out as LMCache's KV_2LTD
``[2, L, n, H * D]`` (keys then values; layers, tokens, heads times head_dim):

* ``lmcache-fp8``: ``fp8.Fp8QuantizationSerializer`` / ``Fp8QuantizationDeserializer``
  (``float8_e4m3fn``, LMCache's default): every element cast to fp8, no scale. A frame body
  is LMCache's serialized bytes: the KV_2LTD tensor's fp8 bytes, one per element.
* ``lmcache-asym-k16-v8``: ``asym_k16_v8.AsymK16V8MultiSerializer`` /
  ``AsymK16V8MultiDeserializer`` (LMCache's defaults: ``float8_e4m3fn``, one float32 scale
  for all of the chunk's values, ``ScaleScope.PER_TENSOR``), given the group ``(K, V)`` of
  the chunk's ``[L, n, H * D]`` keys and values. A frame body is LMCache's serialized blob,
  a self-describing ``lmcache.v1.kv_codec.EncodedKV`` (not a pickle)::

      header    the EncodedKV header: magic, dtypes, scale scope and shape, payload
                lengths, its (empty) model hashes, the payload's CRC-32
      keys      dtype [L, n, H * D]     in the KV's dtype, bit for bit
      values    fp8   [L, n, H * D]     ``value / scale`` cast to float8_e4m3fn
      scale     float32                 max |value| / 448

  The scale spans the layers a stream holds, so a stream of a layer subset does not decode
  to the same values as those layers of a full stream.

One frame is one LMCache chunk (``chunk_tokens`` 256, LMCache's default ``chunk_size``), so a
body is exactly LMCache's serialized form of that chunk: every byte is counted, and decoding
hands the body to LMCache's deserializer. Neither needs parameters in the header. LMCache's
TurboQuant serde needs CUDA (third_party/lmcache/README.md), so it is not wrapped here.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import torch

from cachegen.codec.base import Codec, FrameDecoder, check_size
from cachegen.codec.coding.bitstream import Frame, Header
from cachegen.codec.errors import CodecError
from cachegen.kv import KVCache
from cachegen_lab.codecs.lmcache_peer import LMCACHE_CHUNK_TOKENS, kv_2ltd, put_kv_2ltd

FP8 = torch.float8_e4m3fn  # the fp8 type of both serdes (LMCache's default)
ASYM_SCALE_BYTES = 4  # one float32 scale for the chunk's values (ScaleScope.PER_TENSOR)


@functools.cache
def _lmcache() -> SimpleNamespace:
    """LMCache's modules, imported when first used: loading these codecs' classes (entry points
    loaded with every lab codec) must not import LMCache, nor fail where it is absent."""
    try:
        from lmcache.v1 import memory_management
        from lmcache.v1.distributed.api import MemoryLayoutDesc
        from lmcache.v1.distributed.serde import asym_k16_v8, fp8
        from lmcache.v1.kv_codec import AsymK16V8Codec, errors
    except ImportError as exc:
        raise CodecError(
            "the lmcache-fp8 and lmcache-asym-k16-v8 codecs need LMCache, a peer of the lab: "
            "pip install --no-deps -r requirements/peers.lock (third_party/lmcache/README.md)"
        ) from exc
    return SimpleNamespace(
        memory=memory_management,
        MemoryLayoutDesc=MemoryLayoutDesc,
        fp8=fp8,
        asym=asym_k16_v8,
        AsymK16V8Codec=AsymK16V8Codec,
        errors=errors,
    )


def memory_object(tensor: torch.Tensor, fmt_name: str = "UNDEFINED"):
    """LMCache's ``TensorMemoryObj`` over ``tensor``'s bytes (no copy, no allocator), of
    LMCache's memory format ``fmt_name``."""
    memory = _lmcache().memory
    raw = tensor.contiguous().view(-1).view(torch.uint8)
    meta = memory.MemoryObjMetadata(
        shape=tensor.shape,
        dtype=tensor.dtype,
        address=0,
        phy_size=raw.numel(),
        ref_count=1,
        fmt=memory.MemoryFormat[fmt_name],
    )
    return memory.TensorMemoryObj(raw, meta, None)


def byte_object(data: bytes | memoryview):
    """A serialized chunk as LMCache's deserializers read it: a uint8 buffer object."""
    return memory_object(torch.frombuffer(bytearray(data), dtype=torch.uint8), "BINARY_BUFFER")


def _layout(*tensors: torch.Tensor):
    MemoryLayoutDesc = _lmcache().MemoryLayoutDesc
    return tuple(MemoryLayoutDesc(shapes=[t.shape], dtypes=[t.dtype]) for t in tensors)


def serialize(serializer, src, layout) -> bytes:
    """What LMCache's async processor stores for ``src``: ``serializer`` writes into a buffer
    of its estimated size, narrowed to the bytes it reports (``set_used_size``). Both serdes
    here are content-agnostic: they ignore the object key."""
    size = serializer.estimate_serialized_size(layout)
    dst = memory_object(torch.zeros(size, dtype=torch.uint8), "BINARY_BUFFER")
    dst.set_used_size(serializer.serialize(src, dst, None))
    return bytes(dst.byte_array)


def lmcache_fp8_serialize(chunk: KVCache) -> bytes:
    """LMCache's fp8 serde's bytes of one chunk."""
    kv = kv_2ltd(chunk)
    serializer = _lmcache().fp8.Fp8QuantizationSerializer(FP8)
    return serialize(serializer, memory_object(kv, "KV_2LTD"), *_layout(kv))


def lmcache_asym_serialize(chunk: KVCache) -> bytes:
    """LMCache's asymmetric K16/V8 serde's blob of one chunk."""
    keys, values = kv_2ltd(chunk)
    src = (memory_object(keys), memory_object(values))
    serializer = _lmcache().asym.AsymK16V8MultiSerializer(FP8)
    return serialize(serializer, src, _layout(keys, values))


class _SerdeCodec(Codec):
    """One LMCache chunk per frame, its body LMCache's serialized chunk; one level."""

    def __init__(self, chunk_tokens: int = LMCACHE_CHUNK_TOKENS) -> None:
        super().__init__(chunk_tokens)


class LMCacheFp8Codec(_SerdeCodec):
    name = "lmcache-fp8"
    codec_id = 21

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        return lmcache_fp8_serialize(chunk)

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        return LMCacheFp8Decoder(header)


class LMCacheAsymK16V8Codec(_SerdeCodec):
    name = "lmcache-asym-k16-v8"
    codec_id = 22

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        return lmcache_asym_serialize(chunk)

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        return LMCacheAsymK16V8Decoder(header)


class _SerdeDecoder(FrameDecoder):
    """Decodes a frame with LMCache's deserializer (``lmcache_decode``: KV_2LTD ``[2, L, n,
    H * D]`` in the KV's dtype, as LMCache's deserializer fills it)."""

    def __init__(self, header: Header) -> None:
        super().__init__(header)
        self.channels = header.num_kv_heads * header.head_dim

    def elements(self, n: int) -> int:
        """Keys' (or values') elements of an ``n``-token frame."""
        return self.header.num_layers * n * self.channels

    def lmcache_decode(self, frame: Frame) -> torch.Tensor:
        raise NotImplementedError

    def decode_frame(self, frame: Frame, out: torch.Tensor, token_offset: int) -> None:
        put_kv_2ltd(self.lmcache_decode(frame), self.header, out, token_offset)


class LMCacheFp8Decoder(_SerdeDecoder):
    def check(self, frame: Frame) -> None:
        check_size(frame, 2 * self.elements(len(frame.token_ids)), "lmcache-fp8")

    def lmcache_decode(self, frame: Frame) -> torch.Tensor:
        """What LMCache's ``Fp8QuantizationDeserializer`` writes for this chunk."""
        h, n = self.header, len(frame.token_ids)
        kv = torch.empty((2, h.num_layers, n, self.channels), dtype=h.dtype)
        deserializer = _lmcache().fp8.Fp8QuantizationDeserializer(FP8)
        deserializer.deserialize(byte_object(frame.body), memory_object(kv, "KV_2LTD"), None)
        return kv

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        L, n = self.header.num_layers, len(frame.token_ids)
        return np.full((L, 2), self.elements(n) // L, dtype=np.int64)


class LMCacheAsymK16V8Decoder(_SerdeDecoder):
    def _payload(self, n: int) -> tuple[int, int]:
        """Bytes of the keys and of the values in an ``n``-token blob."""
        return self.elements(n) * self.header.dtype.itemsize, self.elements(n)

    def check(self, frame: Frame) -> None:
        """LMCache's own parse of the blob's header (magic, lengths, payload CRC), then its
        fields against what our header implies."""
        lmcache = _lmcache()
        try:
            enc = lmcache.AsymK16V8Codec(fp8_dtype=FP8).from_bytes(bytes(frame.body))
        except lmcache.errors.CodecError as exc:
            raise CodecError(f"frame {frame.index} is corrupt: lmcache-asym-k16-v8: {exc}") from exc
        layout = (enc.k_dtype, enc.v_dtype, enc.scale_dtype, enc.scale_shape)
        payload = (enc.k_payload_len, enc.v_payload_len, enc.scale_payload_len)
        expected = (*self._payload(len(frame.token_ids)), ASYM_SCALE_BYTES)
        if layout != (self.header.dtype, FP8, torch.float32, ()) or payload != expected:
            raise CodecError(f"frame {frame.index} is corrupt: lmcache-asym-k16-v8 blob layout")
        check_size(frame, len(enc.header_bytes) + sum(payload), "lmcache-asym-k16-v8")

    def lmcache_decode(self, frame: Frame) -> torch.Tensor:
        """What LMCache's ``AsymK16V8MultiDeserializer`` writes for this chunk: keys bit for
        bit, values dequantized, in the KV's dtype."""
        h, n = self.header, len(frame.token_ids)
        kv = torch.empty((2, h.num_layers, n, self.channels), dtype=h.dtype)
        dst = (memory_object(kv[0]), memory_object(kv[1]))  # over kv's keys and values
        deserializer = _lmcache().asym.AsymK16V8MultiDeserializer(FP8)
        deserializer.deserialize(byte_object(frame.body), dst, None)
        return kv

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        """Each layer's keys and values; the blob's header and scale shared evenly."""
        L, n = self.header.num_layers, len(frame.token_ids)
        keys, values = self._payload(n)
        shared = (len(frame.body) - keys - values) / (2 * L)
        return np.tile([keys / L + shared, values / L + shared], (L, 1))
