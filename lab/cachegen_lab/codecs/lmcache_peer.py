"""LMCache's CacheGen (``lmcache==0.5.6``, its CPU path) as a peer codec: ``lmcache-cachegen``.

Nothing of LMCache is changed or re-implemented: this module repeats, line for line, the glue
of LMCache's v1 serde (``lmcache.v1.storage_backend.naive_serde.cachegen_encoder.
CacheGenSerializer.serialize`` and ``cachegen_decoder.CacheGenDeserializer.deserialize``),
which cannot be built without LMCache's storage backends, around the LMCache functions it
calls:

* ``lmcache.v1.storage_backend.naive_serde.cachegen_basics.CacheGenConfig.from_model_name``:
  the bins per layer, for the model's name as vLLM gives it to LMCache (a hub id, or the local
  directory of an embedded, tiny or local model, which LMCache does not list, so it falls back
  to its default: 32 bins for the first 10 key layers and 2 value layers, 16 after; 32 for
  all layers of a model with fewer than 10);
* ``lmcache.storage_backend.serde.cachegen_encoder.encode_function`` (through LMCache's CPU
  device ops: ``calculate_cdf``, ``encode_fast_new``);
* ``lmcache.storage_backend.serde.cachegen_decoder.decode_function_gpu`` (its CPU device op
  ``decode_fast_prefsum``) and ``do_dequantize``;
* the dataclasses ``CacheGenGPUEncoderOutput`` and ``CacheGenGPUBytestream`` of
  ``lmcache.storage_backend.serde.cachegen_basics``, rebuilt from a frame to decode it.

One frame is one LMCache chunk (``chunk_size`` 256, LMCache's default): LMCache serializes a
chunk's ``CacheGenGPUEncoderOutput`` with ``pickle`` and reads it back with ``pickle.load``,
which this project never runs on stored bytes. A frame body holds instead exactly the
tensors of that output, in their dtypes and nothing else, so its size is every byte of
LMCache's serialized form except pickle's framing (the per-chunk CDFs included)::

    lengths   int32 [2L, C]          bytes of each (layer, channel)'s arithmetic code
    cdf       int16 [2L, C, B]       the chunk's CDFs (B = the largest bins + 1)
    max_k     dtype [L, n]           keys' per-token scales, in the KV's dtype
    max_v     dtype [L, n]           values' per-token scales
    code      uint8 [sum(lengths)]   the arithmetic codes, (layer, channel) order

``L`` layers (keys' then values' rows), ``C = heads * head_dim`` channels, ``n`` tokens. The
header's parameters hold the key bins then the value bins of each layer (one byte each), so a
stream decodes without the model's directory.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from cachegen import models
from cachegen.codec.base import Codec, FrameDecoder, check_size
from cachegen.codec.coding.bitstream import Frame, Header
from cachegen.codec.errors import CodecError
from cachegen.kv import KVCache

# LMCache's CacheGenGPUEncoderOutput holds one bytestream per this many tokens
# (CACHEGEN_GPU_MAX_TOKENS_PER_CHUNK), its per-channel code buffer as many bytes.
LMCACHE_CHUNK_TOKENS = 256
# bins such that LMCache's int8 symbols (0 .. bins - 2) and its scale (bins // 2 - 1) are valid
MIN_BINS, MAX_BINS = 4, 128


def _lmcache():
    """LMCache's modules, imported when first used: loading this codec's class (an entry point
    loaded with every lab codec) must not import LMCache, nor fail where it is absent."""
    try:
        import lmcache
        from lmcache.storage_backend.serde import (
            cachegen_basics,
            cachegen_decoder,
            cachegen_encoder,
        )
        from lmcache.v1.storage_backend.naive_serde import cachegen_basics as v1_basics
    except ImportError as exc:
        raise CodecError(
            "the lmcache-cachegen codec needs LMCache, a peer of the lab: "
            "pip install --no-deps -r requirements/peers.lock (third_party/lmcache/README.md)"
        ) from exc
    return lmcache, cachegen_basics, cachegen_encoder, cachegen_decoder, v1_basics


def lmcache_model_name(spec: models.ModelSpec) -> str:
    """The name LMCache sees for ``spec``: vLLM's model argument, a hub id or a directory."""
    return spec.name if spec.source == "hub" else str(spec.path)


def lmcache_bins(model_name: str, num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The key and value bins per layer that LMCache chooses for ``model_name``."""
    *_, v1_basics = _lmcache()
    try:
        config = v1_basics.CacheGenConfig.from_model_name(model_name)
    except ValueError as exc:
        raise CodecError(f"LMCache has no CacheGen bins for model {model_name!r}: {exc}") from exc
    if config.nlayers != num_layers:
        raise CodecError(
            f"LMCache's CacheGen bins for {model_name!r} are for {config.nlayers} layers; "
            f"the KV has {num_layers}"
        )
    return _layer_bins(config.kspecs, num_layers), _layer_bins(config.vspecs, num_layers)


def _model_bins(kv: KVCache) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """LMCache's bins of the layers ``kv`` holds (LMCache itself always codes them all)."""
    keys, values = _named_bins(kv.model.name, kv.model.num_layers)
    keys, values = (tuple(bins[i] for i in kv.layer_indices) for bins in (keys, values))
    if max(keys) != max(values):  # LMCache concatenates K and V CDFs of one width
        raise CodecError(
            f"LMCache's CacheGen cannot code layers {list(kv.layer_indices)} alone: their keys "
            f"have up to {max(keys)} bins and their values {max(values)}"
        )
    return keys, values


@functools.lru_cache(maxsize=16)  # LMCache reads the model's config.json for each name
def _named_bins(name: str, num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    spec = models.resolve(name, prepare=False)
    return lmcache_bins(lmcache_model_name(spec), num_layers)


def _layer_bins(specs, num_layers: int) -> tuple[int, ...]:
    """What LMCache's ``make_key_bins``/``make_value_bins`` fill in, as integers."""
    bins = [0] * num_layers
    for spec in specs:
        bins[spec.start_layer : spec.end_layer] = [spec.bins] * (spec.end_layer - spec.start_layer)
    return tuple(bins)


def _bins_tensor(bins: tuple[int, ...]) -> torch.Tensor:
    """LMCache's bins tensor: float32 on its device (``make_key_bins``)."""
    lmcache, *_ = _lmcache()
    return torch.tensor(bins, dtype=torch.float32).to(lmcache.torch_device_type)


def kv_2ltd(chunk: KVCache) -> torch.Tensor:
    """The chunk as LMCache's KV_2LTD memory object holds it: ``[2, L, n, H * D]`` (keys then
    values; layers, tokens, heads times head_dim)."""
    L, H, n, D = chunk.keys.shape
    kv = torch.stack([chunk.keys, chunk.values]).cpu().permute(0, 1, 3, 2, 4)
    return kv.reshape(2, L, n, H * D).contiguous()


def put_kv_2ltd(kv: torch.Tensor, header: Header, out: torch.Tensor, token_offset: int) -> None:
    """Write ``kv``, a KV_2LTD chunk ``[2, L, n, H * D]``, into ``out`` (our ``[2, L, H,
    tokens, D]``) from ``token_offset`` on."""
    n = kv.shape[2]
    x = kv.view(2, header.num_layers, n, header.num_kv_heads, header.head_dim)
    out[:, :, :, token_offset : token_offset + n] = x.permute(0, 1, 3, 2, 4)


def _lmcache_input(chunk: KVCache) -> torch.Tensor:
    """The chunk as LMCache's serializer reads it: its KV_2LTD memory object, viewed and
    permuted as ``serialize`` does to ``[L, 2, n, H, D]``."""
    L, H, n, D = chunk.keys.shape
    return kv_2ltd(chunk).view(2, L, n, H, D).permute([1, 0, 2, 3, 4])


def lmcache_encode(chunk: KVCache, key_bins: tuple[int, ...], value_bins: tuple[int, ...]):
    """LMCache's ``CacheGenGPUEncoderOutput`` of one chunk (what its serializer pickles)."""
    _, _, cachegen_encoder, _, v1_basics = _lmcache()
    config = v1_basics.CacheGenConfig(chunk.num_layers, [], [])  # encode_function ignores it
    tensor = _lmcache_input(chunk)
    return cachegen_encoder.encode_function(
        tensor, config, _bins_tensor(key_bins), _bins_tensor(value_bins), tensor.shape[2]
    )


def body_of(output) -> bytes:
    """The frame body of one LMCache encoder output: its tensors' bytes (module docstring)."""
    if len(output.data_chunks) != 1:
        raise CodecError("an lmcache-cachegen frame holds one LMCache bytestream")
    stream = output.data_chunks[0]
    parts = (
        stream.bytestream_lengths.to(torch.int32),
        output.cdf.to(torch.int16),
        output.max_tensors_key.squeeze(-1),
        output.max_tensors_value.squeeze(-1),
        stream.bytestream.to(torch.uint8),
    )
    return b"".join(_le_bytes(t) for t in parts)


def _le_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


class LMCacheCacheGenCodec(Codec):
    name = "lmcache-cachegen"
    codec_id = 20

    def __init__(self, chunk_tokens: int = LMCACHE_CHUNK_TOKENS) -> None:
        if not 1 <= int(chunk_tokens) <= LMCACHE_CHUNK_TOKENS:
            raise CodecError(
                f"lmcache-cachegen chunk_tokens must be in 1..{LMCACHE_CHUNK_TOKENS} (one LMCache "
                f"bytestream per frame), got {chunk_tokens}"
            )
        super().__init__(chunk_tokens)

    def params(self, kv: KVCache, level: int) -> bytes:
        key_bins, value_bins = _model_bins(kv)
        return bytes(key_bins + value_bins)

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        return body_of(lmcache_encode(chunk, *_model_bins(chunk)))

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        return LMCacheCacheGenDecoder(header, _parse_bins(header.params, header.num_layers))


def _parse_bins(params: bytes, num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    bins = tuple(params)
    if len(bins) != 2 * num_layers or not all(MIN_BINS <= b <= MAX_BINS for b in bins):
        raise CodecError("lmcache-cachegen bitstream header is corrupt (bins)")
    key_bins, value_bins = bins[:num_layers], bins[num_layers:]
    if max(key_bins) != max(value_bins):  # LMCache concatenates K and V CDFs of one width
        raise CodecError("lmcache-cachegen bitstream header is corrupt (bins)")
    return key_bins, value_bins


class LMCacheCacheGenDecoder(FrameDecoder):
    def __init__(self, header: Header, bins: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
        super().__init__(header)
        self.key_bins, self.value_bins = bins
        self.cdf_width = max(self.key_bins) + 1
        self.channels = header.num_kv_heads * header.head_dim

    def _fixed_sizes(self, n: int) -> tuple[int, int, int]:
        """Bytes of the lengths, the CDFs and one of the two scale tensors."""
        rows = 2 * self.header.num_layers * self.channels
        scale = self.header.num_layers * n * self.header.dtype.itemsize
        return 4 * rows, 2 * rows * self.cdf_width, scale

    def _split(self, frame: Frame):
        """The body's tensors: lengths, cdf, max_k, max_v (``[L, n, 1]``) and the code."""
        h, n = self.header, len(frame.token_ids)
        a, b, s = self._fixed_sizes(n)
        body = bytes(frame.body)
        lengths = _tensor(body[:a], torch.int32).view(2 * h.num_layers, self.channels)
        cdf = _tensor(body[a : a + b], torch.int16)
        max_k = _tensor(body[a + b : a + b + s], h.dtype).view(h.num_layers, n, 1)
        max_v = _tensor(body[a + b + s : a + b + 2 * s], h.dtype).view(h.num_layers, n, 1)
        code = _tensor(body[a + b + 2 * s :], torch.uint8)
        return lengths, cdf.view(*lengths.shape, self.cdf_width), max_k, max_v, code

    def check(self, frame: Frame) -> None:
        a, b, s = self._fixed_sizes(len(frame.token_ids))
        if len(frame.body) < a + b + 2 * s:
            check_size(frame, a + b + 2 * s, "lmcache-cachegen (at least)")
        lengths, cdf, *_ = self._split(frame)
        check_size(frame, a + b + 2 * s + int(lengths.sum()), "lmcache-cachegen")
        if int(lengths.min()) < 0 or int(lengths.max()) > LMCACHE_CHUNK_TOKENS:
            raise CodecError(f"frame {frame.index} is corrupt: lmcache-cachegen code lengths")
        cdf = cdf.numpy().view(np.uint16)
        if (cdf[..., 0] != 0).any() or (np.diff(cdf.astype(np.int32), axis=-1) <= 0).any():
            raise CodecError(f"frame {frame.index} is corrupt: lmcache-cachegen CDFs")

    def decode_frame(self, frame: Frame, out: torch.Tensor, token_offset: int) -> None:
        put_kv_2ltd(self.lmcache_decode(frame), self.header, out, token_offset)

    def lmcache_decode(self, frame: Frame) -> torch.Tensor:
        """What LMCache's ``CacheGenDeserializer.deserialize`` returns for this chunk: KV_2LTD
        ``[2, L, n, H * D]`` in the KV's dtype (its lines, from a frame instead of a pickle)."""
        lmcache, basics, _, cachegen_decoder, _ = _lmcache()
        h = self.header
        lengths, cdf, max_k, max_v, code = self._split(frame)
        stream = basics.CacheGenGPUBytestream(code, lengths, len(frame.token_ids))
        output = basics.CacheGenGPUEncoderOutput(
            [stream], cdf, max_k, max_v, h.num_kv_heads, h.head_dim
        )
        output.max_tensors_key = output.max_tensors_key.to(lmcache.torch_device_type)
        output.max_tensors_value = output.max_tensors_value.to(lmcache.torch_device_type)
        ntokens = output.max_tensors_key.shape[1]
        layers_in_key = output.max_tensors_key.shape[0]
        buffer = torch.zeros((ntokens, 2 * layers_in_key * self.channels), dtype=torch.uint8)
        key, value = cachegen_decoder.decode_function_gpu(
            output.cdf, output.data_chunks, layers_in_key, ntokens, buffer
        )
        key = cachegen_decoder.do_dequantize(
            key, _bins_tensor(self.key_bins), output.max_tensors_key
        )
        value = cachegen_decoder.do_dequantize(
            value, _bins_tensor(self.value_bins), output.max_tensors_value
        )
        nlayers, ntokens, nchannels = key.shape
        blob = torch.stack([key, value]).reshape(2, nlayers, ntokens, h.num_kv_heads, h.head_dim)
        hidden_dim = blob.shape[-1] * blob.shape[-2]
        return blob.reshape(*blob.shape[:-2], hidden_dim).to(h.dtype)

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        L = self.header.num_layers
        a, b, s = self._fixed_sizes(len(frame.token_ids))
        lengths = self._split(frame)[0].view(2, L, self.channels).sum(-1).T.numpy()
        return lengths.astype(np.int64) + (a + b) // (2 * L) + s // L


def _tensor(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
