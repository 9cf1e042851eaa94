"""What a cachegen level costs per element, from its tables or its bins alone: a property of the
profile, not of any KV, so every engine that reads the profile computes the same storage ladder.
"""

from __future__ import annotations

import numpy as np

from cachegen.codec.cachegen.packed import symbol_width
from cachegen.codec.cachegen.quant import QuantConfig, exact_count, num_scales, segment_tokens
from cachegen.codec.coding.tables import LevelTables

SCALE_BITS = 16  # scales are stored as fp16
EXACT_BITS = 16  # exactly stored tokens are bf16


def coded_bits(tables: LevelTables, chunk_tokens: int) -> float:
    """Bits/element of the coded form for a chunk of ``chunk_tokens`` tokens, from the level's
    coding tables: each table row's entropy (the code length its rANS tables give symbols drawn
    from the calibration's distribution) times the tokens it codes, plus the scales and the
    first chunk's exactly stored tokens."""
    config, model = tables.config, tables.model
    freq = tables.freq.astype(np.float64)
    p = freq / freq.sum(axis=1, keepdims=True)
    logs = np.log2(np.where(p > 0, p, 1.0))
    entropy = -(p * logs).sum(axis=1).reshape(model.num_layers, 2, tables.num_segments, -1)
    tokens = [len(t) for t in segment_tokens(chunk_tokens, config.group_size)]
    L, H, D = model.num_layers, model.num_kv_heads, model.head_dim
    bits = sum(float(entropy[:, :, s].sum()) * n for s, n in enumerate(tokens))
    bits += SCALE_BITS * sum(
        num_scales(config.scale(k), L, H, n, D) for k in ("k", "v") for n in tokens
    )
    exact = exact_count(config, 0, chunk_tokens) * 2 * L * H * D
    bits += exact * (EXACT_BITS - float(entropy.mean()))
    return bits / (2 * L * H * D * chunk_tokens)


def packed_bits(config: QuantConfig, heads: int, head_dim: int, chunk_tokens: int) -> float:
    """Bits/element of the packed form for a chunk of ``chunk_tokens`` tokens: each (layer, K/V)'s
    symbol width (the fewest bits that hold its alphabet), plus the scales and the first chunk's
    exactly stored tokens, as the packed form stores them; exact up to the frame's header and
    token ids."""
    L, H, D = config.num_layers, heads, head_dim
    widths = sum(symbol_width(b) for kind in ("k", "v") for b in config.bins(kind))
    bits = widths * H * D * chunk_tokens
    bits += SCALE_BITS * sum(num_scales(config.scale(k), L, H, chunk_tokens, D) for k in ("k", "v"))
    bits += EXACT_BITS * exact_count(config, 0, chunk_tokens) * 2 * L * H * D
    return bits / (2 * L * H * D * chunk_tokens)
