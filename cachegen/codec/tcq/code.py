"""What the ``tcq`` encoder and decoder derive from a model file for one level: the kept
components, their radii, steps and rANS tables (:class:`LevelCode`), the decoder's
per-stream arrays for a set of layers (:class:`StreamTables`), and the frame constants both
sides share."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from cachegen.codec.coding import rans
from cachegen.codec.tcq.int_synthesis import IntegerSynthesis
from cachegen.codec.tcq.model import (
    MAX_RADIUS,
    TcqModel,
    residual_table_offsets,
    residual_targets,
    table_offsets,
)
from cachegen.codec.tcq.predict import LayerPredictor, layer_predictor

EXACT_TOKENS = 1
OFFSET_UNITS = 4  # offsets are in 1 / OFFSET_UNITS of a step
ZLIB_LEVEL = 6  # the DEFLATE level of a frame's choices and refined rows' mask (zlib's default)
# code length in bits of a symbol of frequency f (0 for f = 0: no symbol there to count)
_CODE_BITS = np.concatenate([[0.0], -np.log2(np.arange(1, rans.PROB_SCALE + 1) / rans.PROB_SCALE)])

_KEPT_LAYER_SETS = 4  # decoding tables per level: the whole model and a few layer subsets


def exact_count(start: int, num_tokens: int) -> int:
    return max(0, min(num_tokens, EXACT_TOKENS - start))


def code_lengths(freq_cum: np.ndarray) -> np.ndarray:
    """The code length in bits (float64) of each symbol of packed tables ``freq_cum``."""
    return _CODE_BITS[freq_cum >> 16]


def family_tables(family: np.ndarray, r: int) -> np.ndarray:
    """The family's frequency tables [tables, 2r + 1] for radius ``r``."""
    counts = family[:, np.abs(np.arange(-r, r + 1))].astype(np.int64)
    return rans.quantize_frequencies(counts, np.full(len(family), 2 * r + 1))


@dataclass
class LevelCode:
    """One level's coding state, derived from a :class:`TcqModel`: per (layer, K/V) the kept
    components, their radii and steps; the rANS tables of all kept components."""

    kept: list[list[np.ndarray]]  # [L][2]: component indices
    radius: list[list[np.ndarray]]  # [L][2]: int64 radius of each kept component
    step: list[list[torch.Tensor]]  # [L][2]: float32 step of each kept component
    analysis: list[list[torch.Tensor]]  # [L][2]: kept components' rows over their steps
    synthesis: list[list[np.ndarray]]  # [L][2]: kept components' rows scaled by their steps
    table_base: np.ndarray  # [L, 2]: row of each stream's first table
    freq_cum: np.ndarray  # [tables, width] uint32
    slot_sym: np.ndarray  # [tables, PROB_SCALE] uint8
    family_row: np.ndarray  # [MAX_RADIUS + 1]: row of radius r's first family table, or -1
    family_size: int  # tables of the family (0: the model file has none)
    # absolute layer -> its integer predictor from the layer before (a predicted model file)
    predictors: dict[int, LayerPredictor] = field(default_factory=dict)
    # [L, 2]: row of the first residual table of a predicted layer's targets (-1: none)
    residual_base: np.ndarray | None = None
    decoding: dict = field(default_factory=dict, repr=False, compare=False)  # layers -> tables

    def calibrated_rows(self, layer: int, kind: int, predicted: bool) -> np.ndarray:
        """The calibrated table row of each kept component of (``layer``, ``kind``): its own
        table, or where the layer is ``predicted`` its targets' residual tables."""
        rows = self.table_base[layer, kind] + np.arange(len(self.kept[layer][kind]))
        residual = self.residual_base
        if predicted and residual is not None and residual[layer, kind] >= 0:
            count = self.predictors[layer].targets[kind]
            rows[:count] = residual[layer, kind] + np.arange(count)
        return rows.astype(np.int64)

    def predicted_layers(self, layers: tuple[int, ...]) -> list[tuple[int, LayerPredictor]]:
        """The positions in ``layers`` whose layer is predicted, each with its predictor: those
        with a predictor whose layer before is the previous entry of ``layers``."""
        return [
            (i, self.predictors[layer])
            for i, layer in enumerate(layers)
            if i and layers[i - 1] == layer - 1 and layer in self.predictors
        ]

    @functools.cached_property
    def code_bits(self) -> np.ndarray:
        """[tables, width] float64: the code length of each table's symbols (the encoder's
        table choice; decoders never need it)."""
        return code_lengths(self.freq_cum)

    @functools.cached_property
    def family_bits(self) -> tuple[np.ndarray, np.ndarray]:
        """The family tables' code lengths by symbol, for the encoder's table choice, which
        reads every family table's length of one symbol at once: [symbols, family tables]
        float64, symbol ``v`` of radius ``r`` at row ``start[r] + v``; and ``start``
        [MAX_RADIUS + 1] (-1: no family table of that radius)."""
        start = np.full(MAX_RADIUS + 1, -1, dtype=np.int64)
        blocks = [np.zeros((0, self.family_size))]
        rows = 0
        for r in np.flatnonzero(self.family_row >= 0):
            first = self.family_row[r]
            block = self.code_bits[first : first + self.family_size, : 2 * r + 1].T
            start[r], rows = rows, rows + len(block)
            blocks.append(block)
        return np.ascontiguousarray(np.concatenate(blocks)), start

    def stream_tables(
        self, tcq: TcqModel, layers: tuple[int, ...], predicted: bool = False
    ) -> StreamTables:
        """The decoder's per-stream arrays for ``layers`` (``predicted``: its predicted layers'
        targets take their residual tables), kept for the last few layer sets."""
        key = (layers, predicted)
        if key not in self.decoding:
            while len(self.decoding) >= _KEPT_LAYER_SETS:
                self.decoding.pop(next(iter(self.decoding)))
            self.decoding[key] = _stream_tables(tcq, self, layers, predicted)
        return self.decoding[key]


@dataclass
class StreamTables:
    """A level's decoding state for a set of layers, one entry per (layer, K/V) stream in
    stream order: kept component counts, first table rows, the kept radii (int64, one
    stream after another from ``radius_off``), channel means [streams, channels] and the
    synthesis matrices [streams, width, channels] (kept components' rows scaled by their
    steps, zero rows up to ``width``, the largest kept count rounded up to even: the integer
    product takes rows in pairs), in float32 and bfloat16, and in int16
    (:attr:`integer_synthesis`, made on first use)."""

    kept: np.ndarray
    table_base: np.ndarray
    table_row: np.ndarray  # calibrated table row of every kept component, from radius_off
    slot: np.ndarray  # each kept component's flat index in [streams, width]
    radius_int: np.ndarray
    radius_off: np.ndarray
    mean: np.ndarray
    synthesis: torch.Tensor
    synthesis_bf16: torch.Tensor

    @property
    def width(self) -> int:
        return self.synthesis.shape[1]

    @functools.cached_property
    def integer_synthesis(self) -> IntegerSynthesis:
        return IntegerSynthesis.of(self.synthesis)


def _stream_tables(
    tcq: TcqModel, code: LevelCode, layers: tuple[int, ...], predicted: bool
) -> StreamTables:
    pairs = [(layer, k) for layer in layers for k in (0, 1)]
    positions = {i for i, _ in code.predicted_layers(layers)} if predicted else set()
    kept = np.array([len(code.kept[layer][k]) for layer, k in pairs], dtype=np.int64)
    channels = tcq.mean.shape[-1]
    most = int(kept.max(initial=0))
    width = max(2, most + most % 2)
    synthesis = torch.zeros((len(pairs), width, channels))
    for s, (layer, k) in enumerate(pairs):
        synthesis[s, : kept[s]] = torch.from_numpy(code.synthesis[layer][k])
    radius = np.concatenate([code.radius[layer][k] for layer, k in pairs])
    table_base = np.array([code.table_base[layer, k] for layer, k in pairs], dtype=np.int64)
    return StreamTables(
        kept=kept,
        table_base=table_base,
        table_row=np.concatenate(
            [np.zeros(0, np.int64)]
            + [
                code.calibrated_rows(layer, k, s // 2 in positions)
                for s, (layer, k) in enumerate(pairs)
            ]
        ),
        slot=np.concatenate([s * width + np.arange(c) for s, c in enumerate(kept)]).astype(
            np.int64
        ),
        radius_int=radius.astype(np.int64),
        radius_off=np.concatenate([[0], np.cumsum(kept)[:-1]]).astype(np.int64),
        mean=np.ascontiguousarray(tcq.mean[list(layers)].reshape(len(pairs), channels)),
        synthesis=synthesis,
        synthesis_bf16=synthesis.to(torch.bfloat16),
    )


def level_code(tcq: TcqModel, level: int) -> LevelCode:
    """``level``'s coding state (kept for the last few levels of the last few model files)."""
    return _level_code(tcq, tcq.level_index(level))


@functools.lru_cache(maxsize=8)
def _level_code(tcq: TcqModel, index: int) -> LevelCode:
    radius = tcq.radius[index].astype(np.int64)
    starts = table_offsets(tcq.radius)[index]
    L, _, C = radius.shape
    width = max(3, 2 * int(radius.max()) + 1)
    kept, radii, steps, analysis, synthesis, rows = [], [], [], [], [], []
    base = np.zeros((L, 2), dtype=np.int64)
    count = 0
    for layer in range(L):
        kept.append([]), radii.append([]), steps.append([])
        analysis.append([]), synthesis.append([])
        for k in range(2):
            idx = np.flatnonzero(radius[layer, k])
            kept[layer].append(idx)
            radii[layer].append(radius[layer, k][idx])
            step = tcq.steps[index, layer, k][idx]
            steps[layer].append(torch.from_numpy(step.copy()))
            rows_over_steps = tcq.components[layer, k][idx] / step[:, None]
            analysis[layer].append(torch.from_numpy(rows_over_steps.astype(np.float32)))
            scaled = step[:, None].astype(np.float32) * tcq.components[layer, k][idx]
            synthesis[layer].append(np.ascontiguousarray(scaled, dtype=np.float32))
            base[layer, k] = count
            count += len(idx)
            for i in idx:
                table = np.zeros(width, dtype=np.uint16)
                n = 2 * int(radius[layer, k, i]) + 1
                table[:n] = tcq.freq[starts[layer, k, i] : starts[layer, k, i] + n]
                rows.append(table)
    residual_base = _residual_rows(tcq, index, width, rows)
    family_row = np.full(MAX_RADIUS + 1, -1, dtype=np.int64)
    if tcq.adaptive:
        for r in np.unique(radius[radius > 0]):
            tables = family_tables(tcq.family, int(r))
            family_row[r] = len(rows)
            for table in tables:
                rows.append(np.pad(table, (0, width - len(table))).astype(np.uint16))
    freq = np.stack(rows) if rows else np.zeros((1, width), dtype=np.uint16)
    slot = rans.slot_table(freq) if rows else np.zeros((1, rans.PROB_SCALE), np.uint8)
    return LevelCode(
        kept,
        radii,
        steps,
        analysis,
        synthesis,
        base,
        rans.pack_freq_cum(freq),
        slot,
        family_row,
        len(tcq.family),
        _predictors(tcq, index, kept),
        residual_base,
    )


def _residual_rows(tcq: TcqModel, index: int, width: int, rows: list) -> np.ndarray:
    """Append level ``index``'s residual tables to ``rows``; [L, 2] the row of each predicted
    (layer, K/V)'s first one (-1: none)."""
    L = tcq.radius.shape[1]
    base = np.full((L, 2), -1, dtype=np.int64)
    for (x, layer, k), start in residual_table_offsets(tcq).items():
        if x != index:
            continue
        base[layer, k] = len(rows)
        for r in tcq.radius[index, layer, k][residual_targets(tcq, index, layer, k)]:
            n = 2 * int(r) + 1
            rows.append(np.pad(tcq.residual_freq[start : start + n], (0, width - n)))
            start += n
    return base


def _predictors(tcq: TcqModel, index: int, kept: list[list[np.ndarray]]) -> dict:
    """Each predicted layer's integer predictor at level ``index`` (none without a predictor;
    a layer whose shift is 0 is not predicted)."""
    if not tcq.predicted:
        return {}
    shifts, steps, radius = tcq.predictor_shift[index], tcq.steps[index], tcq.radius[index]
    return {
        layer: layer_predictor(tcq.predictor[layer], kept, steps, radius, layer, int(shift))
        for layer, shift in enumerate(shifts)
        if layer and shift
    }


def table_rows(
    code: LevelCode, radius: np.ndarray, choice: np.ndarray, calibrated: np.ndarray
) -> np.ndarray:
    """Table rows of components with ``radius`` and ``choice`` (0: their ``calibrated`` rows)."""
    family = code.family_row[radius.astype(np.int64)] + choice.astype(np.int64) - 1
    return np.where(choice == 0, calibrated, family)
