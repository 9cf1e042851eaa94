"""KVTC (KV cache transform coding, ICLR 2026) as a codec: ``kvtc``.

Per layer, keys and values each go through a PCA basis over all heads' channels together,
fitted once per model on calibration text (``cachegen.fitting.kvtc.ensure_kvtc_basis``; keys
turned back to their pre-RoPE form first). Each level is a budget of bits per element; the
basis file holds each level's allocation of 0..8 bits to the principal components
(components given 0 bits are dropped), chosen by
:func:`~cachegen.codec.transform.basis.allocate_bits` from the components' variances. A component's
coefficient, divided by its calibration standard deviation, is coded with the Lloyd-Max quantizer
of its bits; the codes are packed at their width (bytes per symbol would cost DEFLATE's Huffman
code at least a bit for every 1-bit symbol) and every (layer, K/V) stream is compressed with
DEFLATE (zlib). As published, the first ``EXACT_TOKENS`` tokens of a sequence (the attention sinks)
are stored exactly.

The header's codec parameters are the basis id (16 bytes); the decoder reads the basis from
the transforms directory (``cachegen.codec.transform.basis``), never from a model. Frame body::

    exact      tokens at positions below EXACT_TOKENS: keys then values [L, H, e, D] in the
               KV's dtype (empty in most frames)
    directory  u32 compressed size of each stream, streams ordered (layer, K/V)
    streams    zlib streams; stream (l, K/V) inflates to the codes of its kept components, by
               width from 8 bits down: the codes [components of that width, tokens - e] packed
               at that width (little-endian bit order)

The basis is shared per model like the cachegen codec's tables: a bitstream's size is the
bitstream, and ``inspect`` reports the basis and its size separately.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

from cachegen import models
from cachegen.codec.base import FrameDecoder, ModelCodec, kv_tensor
from cachegen.codec.coding.bitstream import Frame, Header
from cachegen.codec.errors import CodecError
from cachegen.codec.transform.basis import TransformBasis, find_basis
from cachegen.codec.transform.kvtc_basis import EXACT_TOKENS, load_kvtc_basis
from cachegen.codec.transform.lloyd_max import MAX_BITS, dequantize, quantize
from cachegen.codec.transform.packing import inflate_exactly, pack_bits, packed_size, unpack_bits
from cachegen.codec.transform.rotary import rotate_layer_keys
from cachegen.constants import CHUNK_TOKENS
from cachegen.kv import KVCache

BASIS_ID_BYTES = 16
ZLIB_LEVEL = 9
DEFAULT_LEVEL = 20


def _exact_count(start: int, num_tokens: int) -> int:
    return max(0, min(num_tokens, EXACT_TOKENS - start))


def _kept(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the components given bits, and their bits."""
    kept = np.flatnonzero(bits)
    return kept, bits[kept]


def _widths(kept_bits: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(width, positions among the kept components) of each width present, widest first."""
    return [
        (b, np.flatnonzero(kept_bits == b))
        for b in range(MAX_BITS, 0, -1)
        if np.any(kept_bits == b)
    ]


def _packed_bytes(kept_bits: np.ndarray, tokens: int) -> int:
    return sum(packed_size(len(cols) * tokens, b) for b, cols in _widths(kept_bits))


class KvtcCodec(ModelCodec):
    name = "kvtc"
    codec_id = 10
    fitted_kind = "basis"

    def __init__(
        self,
        model: models.ModelSpec | str | None = None,
        chunk_tokens: int = CHUNK_TOKENS,
        basis: TransformBasis | None = None,
    ) -> None:
        super().__init__(model, chunk_tokens, basis)

    load_fitted = staticmethod(load_kvtc_basis)

    @property
    def basis(self) -> TransformBasis:
        return self.fitted

    @property
    def default_level(self) -> int:
        return DEFAULT_LEVEL if DEFAULT_LEVEL in self.basis.levels else self.levels[0]

    def encode(self, kv: KVCache, level: int | None = None) -> bytes:
        self.fit_for(kv)
        self.basis.check_model(kv.model)
        return super().encode(kv, level)

    def params(self, kv: KVCache, level: int) -> bytes:
        return bytes.fromhex(self.basis.id)

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        basis = self.basis
        layers = list(chunk.layer_indices)
        bits = basis.level_bits(level)[layers]
        e = _exact_count(chunk.start, chunk.num_tokens)
        x = kv_tensor(chunk)
        parts = [x[:, :, :, :e].contiguous().view(torch.uint8).numpy().tobytes()]
        q = x[:, :, :, e:].to(torch.float32)
        thetas = tuple(basis.rope_thetas[i] for i in layers)
        if any(thetas):
            q[0] = rotate_layer_keys(q[0], chunk.start + e, thetas, inverse=True)
        L, H, n, D = q.shape[1:]
        streams = []
        for i, layer in enumerate(layers):
            for k in range(2):
                kept, kept_bits = _kept(bits[i, k])
                rows = q[k, i].permute(1, 0, 2).reshape(n, H * D)
                streams.append(_encode_stream(basis, layer, k, rows, kept, kept_bits))
        parts.append(struct.pack(f"<{len(streams)}I", *map(len, streams)))
        return b"".join(parts + streams)

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        if len(header.params) != BASIS_ID_BYTES:
            raise CodecError("kvtc bitstream header is corrupt (parameters)")
        basis = find_basis(header.params.hex(), header.model)
        basis.level_bits(header.level)
        return KvtcDecoder(header, basis)


def _encode_stream(
    basis: TransformBasis,
    layer: int,
    kind: int,
    rows: torch.Tensor,
    kept: np.ndarray,
    kept_bits: np.ndarray,
) -> bytes:
    """The zlib stream of one (layer, K/V): ``rows`` [tokens, channels] float32."""
    if not len(kept) or not len(rows):
        return zlib.compress(b"", ZLIB_LEVEL)
    mean = torch.from_numpy(basis.mean[layer, kind])
    components = torch.from_numpy(basis.components[layer, kind][kept])
    sigma = torch.from_numpy(np.sqrt(basis.variances[layer, kind][kept]))
    y = (rows - mean) @ components.T / sigma
    codes = quantize(y, kept_bits).T
    packed = b"".join(pack_bits(codes[torch.from_numpy(cols)], b) for b, cols in _widths(kept_bits))
    return zlib.compress(packed, ZLIB_LEVEL)


class KvtcDecoder(FrameDecoder):
    def __init__(self, header: Header, basis: TransformBasis) -> None:
        super().__init__(header)
        self.basis = basis
        self.layers = list(header.layer_indices)
        self.bits = basis.level_bits(header.level)[self.layers]
        self.kept = [[_kept(self.bits[i, k]) for k in range(2)] for i in range(len(self.layers))]

    def _frame_start(self, frame: Frame) -> int:
        return self.header.start + frame.index * self.header.chunk_tokens

    def _layout(self, frame: Frame) -> tuple[int, int, list[int]]:
        """(exact tokens, exact bytes, stream sizes) after checking them against the body."""
        h = self.header
        n = len(frame.token_ids)
        e = _exact_count(self._frame_start(frame), n)
        exact = 2 * h.num_layers * h.num_kv_heads * e * h.head_dim * h.dtype.itemsize
        count = 2 * h.num_layers
        body = frame.body
        if len(body) < exact + 4 * count:
            raise CodecError(
                f"frame {frame.index} is corrupt: kvtc body is {len(body)} bytes, too short for "
                f"its exact tokens and stream directory"
            )
        sizes = list(struct.unpack_from(f"<{count}I", body, exact))
        if exact + 4 * count + sum(sizes) != len(body):
            raise CodecError(
                f"frame {frame.index} is corrupt: kvtc stream sizes do not add up to the body"
            )
        return e, exact, sizes

    def check(self, frame: Frame) -> None:
        self._layout(frame)

    def decode_frame(self, frame: Frame, out: torch.Tensor, token_offset: int) -> None:
        h = self.header
        n = len(frame.token_ids)
        e, exact, sizes = self._layout(frame)
        L, H, D = h.num_layers, h.num_kv_heads, h.head_dim
        end = token_offset + n
        if e:
            raw = torch.frombuffer(bytearray(frame.body[:exact]), dtype=torch.uint8)
            out[:, :, :, token_offset : token_offset + e] = raw.view(h.dtype).view(2, L, H, e, D)
        m = n - e
        q = torch.empty((2, L, H, m, D), dtype=torch.float32)
        pos = exact + 4 * len(sizes)
        for i, layer in enumerate(self.layers):
            for k in range(2):
                size = sizes[i * 2 + k]
                stream = frame.body[pos : pos + size]
                pos += size
                rows = self._decode_stream(frame, stream, layer, k, *self.kept[i][k], m)
                q[k, i] = rows.view(m, H, D).permute(1, 0, 2)
        thetas = tuple(self.basis.rope_thetas[i] for i in self.layers)
        if any(thetas):
            q[0] = rotate_layer_keys(q[0], self._frame_start(frame) + e, thetas)
        out[:, :, :, token_offset + e : end] = q

    def _decode_stream(
        self,
        frame: Frame,
        stream: memoryview,
        layer: int,
        kind: int,
        kept: np.ndarray,
        kept_bits: np.ndarray,
        tokens: int,
    ) -> torch.Tensor:
        expected = _packed_bytes(kept_bits, tokens)
        raw = inflate_exactly(
            bytes(stream),
            expected,
            f"frame {frame.index} is corrupt: a kvtc stream does not inflate",
            f"frame {frame.index} is corrupt: a kvtc stream inflates to the wrong size",
        )
        mean = torch.from_numpy(self.basis.mean[layer, kind])
        if not expected:
            return mean.expand(tokens, -1)
        codes = torch.empty((len(kept), tokens), dtype=torch.uint8)
        pos = 0
        for b, cols in _widths(kept_bits):
            size = packed_size(len(cols) * tokens, b)
            codes[torch.from_numpy(cols)] = unpack_bits(
                raw[pos : pos + size], b, len(cols) * tokens
            ).view(len(cols), tokens)
            pos += size
        codes = codes.T
        sigma = torch.from_numpy(np.sqrt(self.basis.variances[layer, kind][kept]))
        components = torch.from_numpy(self.basis.components[layer, kind][kept])
        return (dequantize(codes, kept_bits) * sigma) @ components + mean

    def inspect_extras(self) -> dict:
        return {"transform": self.basis.id, "transform_bytes": self.basis.nbytes}

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        e, exact, sizes = self._layout(frame)
        h = self.header
        per_stream = np.asarray(sizes, dtype=np.float64).reshape(h.num_layers, 2)
        return per_stream + (exact + 4 * len(sizes)) / (2 * h.num_layers)
