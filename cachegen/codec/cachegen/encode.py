"""Encoding the cachegen codec's frame bodies, both forms (layout: ``cachegen_codec.py``).

Quantization (``quant.py``) turns a chunk's keys and values into symbol segments and their
scales; the coded form rANS-codes each (layer, K/V, segment) of symbols (``rans.py``), the
packed form bit-packs it (``packed.py``). A chunk of a layer subset uses the settings of its
layers' absolute indices (:func:`layer_config`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from cachegen.codec.cachegen import packed
from cachegen.codec.cachegen.quant import QuantConfig, exact_count, quantize_chunk
from cachegen.codec.coding import rans
from cachegen.codec.coding.parallel import run_batches
from cachegen.codec.coding.tables import KINDS, LevelTables
from cachegen.kv import KVCache, ModelIdentity


@functools.lru_cache(maxsize=64)
def layer_config(config: QuantConfig, layers: tuple[int, ...] | None) -> QuantConfig:
    """``config`` for a KV that holds only ``layers`` (absolute indices; None: all): the bins
    and rotary bases of those layers, in their order, so that index ``i`` of the result is
    layer ``layers[i]`` of the model. Everything else applies to every layer alike."""
    if layers is None:
        return config
    thetas = config.layer_thetas
    return dataclasses.replace(
        config,
        key_bins=tuple(config.key_bins[i] for i in layers),
        value_bins=tuple(config.value_bins[i] for i in layers),
        rope_theta=tuple(thetas[i] for i in layers),
    )


def exact_section_bytes(layers: int, model: ModelIdentity, tokens: int, dtype: torch.dtype) -> int:
    """Size of a frame body's exact section holding ``tokens`` tokens (keys and values) of
    ``layers`` layers."""
    return 2 * layers * model.num_kv_heads * tokens * model.head_dim * dtype.itemsize


def exact_bytes(chunk: KVCache, config: QuantConfig) -> int:
    """Size of the frame body's exact section for ``chunk``."""
    return exact_section_bytes(
        chunk.num_layers,
        chunk.model,
        exact_count(config, chunk.start, chunk.num_tokens),
        chunk.dtype,
    )


def _quantized(chunk: KVCache, config: QuantConfig) -> tuple[list[bytes], list[np.ndarray]]:
    """The body's exact section and scales (its first parts, in order), and the symbols
    ``[L, H, n_s, D]`` of each (K/V, segment), as both forms store them."""
    e = exact_count(config, chunk.start, chunk.num_tokens)
    exact = torch.stack([chunk.keys[:, :, :e], chunk.values[:, :, :e]]).cpu().contiguous()
    parts: list[bytes] = [exact.view(torch.uint8).numpy().tobytes()]
    segments: list[np.ndarray] = []
    for kind in KINDS:
        x = chunk.keys if kind == "k" else chunk.values
        for seg in quantize_chunk(x, config, kind, chunk.start):
            parts.append(seg.scales.cpu().numpy().tobytes())
            # quantization may run on a GPU, coding runs here
            segments.append(np.ascontiguousarray(seg.symbols.cpu().numpy()))
    return parts, segments


def encode_chunk(chunk: KVCache, tables: LevelTables) -> bytes:
    """Frame body for one chunk (see ``cachegen_codec.py``); ``chunk`` may hold a subset of
    the layers (``chunk.layers``)."""
    L = chunk.num_layers
    parts, segments = _quantized(chunk, layer_config(tables.config, chunk.layers))
    S = len(segments) // 2
    outputs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per (K/V, segment)
    for j, sym in enumerate(segments):
        k, s = divmod(j, S)
        capacity = sym[0].size + rans.STATE_WORDS
        out_off = np.arange(L + 1, dtype=np.int64) * capacity
        out = np.empty(int(out_off[-1]), dtype=np.uint16)
        start = np.empty(L, dtype=np.int64)
        base = np.array([tables.base(layer, k, s) for layer in chunk.layer_indices], np.int64)
        run_batches(
            lambda todo, sym=sym, base=base, out=out, out_off=out_off, start=start: (
                rans.encode_layers(sym, base, tables.freq_cum, out, out_off, todo, start)
            ),
            np.ones(L),
        )
        outputs.append((out, start, out_off))
    # streams ordered (layer, K/V, segment)
    streams = [
        out[start[layer] : off[layer + 1]] for layer in range(L) for out, start, off in outputs
    ]
    lengths = np.array([len(w) for w in streams], dtype="<u4")
    return b"".join(parts) + lengths.tobytes() + np.concatenate(streams).astype("<u2").tobytes()


def stream_widths(config: QuantConfig, num_segments: int) -> np.ndarray:
    """Packed width of each stream, ordered (layer, K/V, segment), of the layers ``config``
    describes."""
    return np.array(
        [
            packed.symbol_width(config.bins(kind)[layer])
            for layer in range(config.num_layers)
            for kind in KINDS
            for _ in range(num_segments)
        ],
        dtype=np.uint8,
    )


def encode_packed_chunk(chunk: KVCache, level_config: QuantConfig) -> bytes:
    """Packed-form frame body for one chunk: the coded form's exact tokens and scales, then
    one width byte per stream and the bit-packed streams, ordered (layer, K/V, segment)."""
    L = chunk.num_layers
    config = layer_config(level_config, chunk.layers)
    parts, segments = _quantized(chunk, config)
    per_layer = len(segments)  # streams per layer: K/V times segments
    widths = stream_widths(config, per_layer // 2)
    counts = np.tile([sym[0].size for sym in segments], L)
    sizes = packed.packed_bytes(counts, widths.astype(np.int64))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    out = np.zeros(int(offsets[-1]), dtype=np.uint8)
    for j, sym in enumerate(segments):
        streams = np.arange(L) * per_layer + j  # this segment's stream in each layer
        run_batches(
            lambda todo, sym=sym, streams=streams: packed.pack_layers(
                sym, widths[streams], out, offsets[streams], todo
            ),
            np.ones(L),
        )
    return b"".join(parts) + widths.tobytes() + out.tobytes()
