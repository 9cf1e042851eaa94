"""What a tcq level costs per element, from its model file alone: a property of the model file,
not of any KV, so every engine that reads it computes the same storage ladder (as
:mod:`cachegen.codec.cachegen.size` does for cachegen's levels from their tables).

Both forms are estimated for a chunk at the start of a prompt (its first token stored
exactly), up to the frame's header and token ids. The coded form codes each kept component's
symbols at about its calibrated table's entropy (a predicted layer's targets: their residual
table's; the frame's own offsets and table choices win back what held-out text loses against
the calibration text); the packed form stores each kept component at the width its symbols
span in the frame, estimated from the calibrated table (of the symbols, never predicted).
A coded frame's refined rows are not counted: which rows a frame refines depends on its KV,
not on the model file (what they cost: docs/codec.md, "Refined rows").
"""

from __future__ import annotations

import numpy as np

from cachegen.codec.coding import rans
from cachegen.codec.tcq.code import exact_count
from cachegen.codec.tcq.model import (
    TcqModel,
    residual_table_offsets,
    residual_targets,
    table_offsets,
)
from cachegen.codec.tcq.packed import GROUP
from cachegen.modes import CODED

EXACT_BITS = 16  # exactly stored tokens are bf16
DIRECTORY_BITS = 32  # a coded frame's u32 word count per stream
CHOICE_BITS = 16  # a kept component's offset and table choice per coded frame, before DEFLATE
CHOICE_LENGTH_BITS = 32  # the u32 byte count of a coded frame's choices
FIELD_BITS = 8  # a packed frame's offset, low and width per kept component, one byte each


def estimated_bits(tcq: TcqModel, level: int, chunk_tokens: int, form: str = CODED) -> float:
    """Bits/element of ``level`` of ``tcq`` in ``form`` for a chunk of ``chunk_tokens``
    tokens (:func:`coded_bits`, :func:`packed_bits`)."""
    if form == CODED:
        return coded_bits(tcq, level, chunk_tokens)
    return packed_bits(tcq, level, chunk_tokens)


def coded_bits(tcq: TcqModel, level: int, chunk_tokens: int) -> float:
    """Bits/element of the coded form: each kept component's calibrated table's entropy times
    the tokens it codes, the frame's choices (counted before DEFLATE), each stream's directory
    word and rANS states, and the exactly stored first token."""
    tables = _coded_tables(tcq, level)
    coded = chunk_tokens - exact_count(0, chunk_tokens)
    streams = len(tcq.mean) * 2
    bits = coded * float(_entropies(tables).sum())
    bits += streams * DIRECTORY_BITS + _streams_with_kept(tcq, level) * rans.STATE_WORDS * 16
    if tcq.adaptive:
        bits += CHOICE_LENGTH_BITS + CHOICE_BITS * len(tables)
    return (bits + _exact_bits(tcq, chunk_tokens)) / _elements(tcq, chunk_tokens)


def packed_bits(tcq: TcqModel, level: int, chunk_tokens: int) -> float:
    """Bits/element of the packed form: each kept component's symbols at its estimated width
    (:func:`symbol_widths`) in whole groups, its side fields, and the exactly stored first
    token."""
    tables = _tables(tcq, level)
    coded = chunk_tokens - exact_count(0, chunk_tokens)
    groups = -(-coded // GROUP)
    fields = 3 if tcq.adaptive else 2  # the offset (frames with choices only), low, width
    bits = groups * GROUP * int(symbol_widths(tables, coded).sum())
    bits += fields * FIELD_BITS * len(tables)
    return (bits + _exact_bits(tcq, chunk_tokens)) / _elements(tcq, chunk_tokens)


def symbol_widths(tables: np.ndarray, tokens: int) -> np.ndarray:
    """The bits a frame of ``tokens`` tokens likely needs for each component coded with a row
    of ``tables`` (calibrated frequencies, zero past each alphabet): those that hold the range
    between the row's quantiles at ``1 / (2 tokens)`` from either end, the symbols a frame's
    smallest and largest land near. A table's floor (one count, which rANS gives every symbol
    of the alphabet) is left out: on the calibration text those symbols did not occur, and
    counted they would stretch a wide alphabet's range to its ends."""
    counts = np.maximum(tables.astype(np.float64) - 1, 0)
    flat = counts.sum(axis=1) == 0  # a flat table: every symbol of the alphabet as likely
    counts[flat] = tables[flat]
    cdf = np.cumsum(counts, axis=1) / counts.sum(axis=1, keepdims=True)
    tail = 1 / (2 * tokens)
    low = (cdf <= tail).sum(axis=1)
    size = (tables > 0).sum(axis=1)
    high = np.minimum((cdf < 1 - tail).sum(axis=1), size - 1)
    span = np.maximum(high - low, 0)
    return np.ceil(np.log2(span + 1)).astype(np.int64)  # bit lengths, as the encoder's


def _tables(tcq: TcqModel, level: int) -> np.ndarray:
    """The calibrated frequency tables of ``level``'s kept components, one row each, zero past
    each component's alphabet."""
    index = tcq.level_index(level)
    radius = tcq.radius[index].reshape(-1).astype(np.int64)
    kept = np.flatnonzero(radius)
    starts = table_offsets(tcq.radius)[index].reshape(-1)[kept]
    sizes = 2 * radius[kept] + 1
    at = np.arange(int(sizes.max(initial=1)))
    inside = at < sizes[:, None]
    tables = np.zeros(inside.shape, dtype=np.int64)
    tables[inside] = tcq.freq[(starts[:, None] + at)[inside]]
    return tables


def _coded_tables(tcq: TcqModel, level: int) -> np.ndarray:
    """:func:`_tables`, with the predicted layers' targets' rows their residual tables (what
    a whole-model stream codes them with)."""
    index = tcq.level_index(level)
    tables = _tables(tcq, level)
    counts = (tcq.radius[index] > 0).sum(axis=-1).reshape(-1)
    first = np.concatenate([[0], np.cumsum(counts)])  # row of each (layer, K/V)'s first
    for (x, layer, k), start in residual_table_offsets(tcq).items():
        if x != index:
            continue
        row = int(first[2 * layer + k])
        for r in tcq.radius[index, layer, k][residual_targets(tcq, index, layer, k)]:
            n = 2 * int(r) + 1
            tables[row, :n] = tcq.residual_freq[start : start + n]
            row, start = row + 1, start + n
    return tables


def _entropies(tables: np.ndarray) -> np.ndarray:
    p = tables / tables.sum(axis=1, keepdims=True)
    return -(p * np.log2(np.where(p > 0, p, 1.0))).sum(axis=1)


def _streams_with_kept(tcq: TcqModel, level: int) -> int:
    return int((tcq.radius[tcq.level_index(level)] > 0).any(axis=-1).sum())


def _exact_bits(tcq: TcqModel, chunk_tokens: int) -> int:
    layers, _, channels = tcq.mean.shape
    return EXACT_BITS * exact_count(0, chunk_tokens) * 2 * layers * channels


def _elements(tcq: TcqModel, chunk_tokens: int) -> int:
    layers, _, channels = tcq.mean.shape
    return 2 * layers * channels * chunk_tokens
