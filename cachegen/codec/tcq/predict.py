"""Cross-layer prediction of ``tcq``'s coded symbols, in integers.

A layer's keys and values and the layer before them are read from the same residual stream, so a
linear function of layer ``l - 1``'s quantized coefficients predicts part of layer ``l``'s. tcq
predicts in the symbols' own domain with integer arithmetic only: the prediction changes which
symbols are coded, never the quantized values, so a predicted stream decodes to the KV of the
same level without prediction, bit for bit, on every CPU.

For level ``x`` and layer ``l`` (when layer ``l - 1`` is in the stream too) the *sources* are
layer ``l - 1``'s kept key components, then its kept value components, each as ``4 q_j + o_j``
(its centred symbol ``q_j`` in ``[-r_j, r_j]`` in quarter steps, plus the frame's offset
``o_j``); the *targets* are layer ``l``'s kept key and value components among the first ``T`` of
each (``T``, the predictor's last dimension, keeps the product small). From the model file's
float16 predictor ``P[l][k]`` (coefficient units, fitted on the calibration text) the level's
integer matrix is ``M_jt = round_half_even(P[l][k][c_j, c_t] * step_j / step_t * 2**s)``
(float64, every operation correctly rounded: the same integers on every machine), ``s`` the
file's ``predictor_shift[x][l]``. Target ``t``'s guess is ``g_t = round_half_even((sum_j src_j
M_jt - o_t * 2**s) / 2**(s + 2))``. Every target of every level has ``sum_j (4 r_j + 127) |M_jt|
+ 127 * 2**s < 2**24``, so each sum is exact in float32 whatever the order of its terms or the
BLAS (checked when a level is derived; a file that breaks it is refused). The coded symbol is
the target's centred symbol less its guess, wrapped into its alphabet: ``((q_t - g_t + r_t) mod
(2 r_t + 1)) - r_t``; the decoder adds the guess back and wraps the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from cachegen.codec.errors import CodecError

EXACT_LIMIT = 1 << 24  # float32 holds every integer below this exactly
OFFSET_BOUND = 127  # an offset's largest magnitude (quarter steps, i8 clamped to +-127)
QUARTER = 2  # sources are in quarter steps: 2**QUARTER of them per step


@dataclass(frozen=True)
class LayerPredictor:
    """Layer ``l``'s integer predictor at one level: ``matrix`` [sources, targets] (float32
    holding integers; sources: layer ``l - 1``'s kept keys then values, targets: layer ``l``'s
    first ``targets[0]`` kept keys then first ``targets[1]`` kept values) and its ``shift``."""

    matrix: np.ndarray
    shift: int
    sources: tuple[int, int]
    targets: tuple[int, int]


def integer_matrix(weights: np.ndarray, source_steps, target_steps, shift: int) -> np.ndarray:
    """``round_half_even(weights * source_step / target_step * 2**shift)`` in float64 (int64)."""
    scaled = weights.astype(np.float64) * source_steps.astype(np.float64)[:, None]
    scaled = scaled / target_steps.astype(np.float64)[None, :]
    return np.round(scaled * 2.0**shift).astype(np.int64)


def exact_bound(matrix: np.ndarray, source_radius: np.ndarray, shift: int) -> int:
    """The largest ``sum_j (4 r_j + 127) |M_jt| + 127 * 2**shift`` over the targets (exact)."""
    weight = (source_radius.astype(np.int64) << QUARTER) + OFFSET_BOUND
    if not matrix.size:
        return 0
    return int((weight @ np.abs(matrix)).max()) + (OFFSET_BOUND << shift)


def layer_selection(kept: np.ndarray, targets: int) -> np.ndarray:
    """The kept components (indices, increasing) that are targets: those below ``targets``."""
    return kept[kept < targets]


def layer_predictor(
    weights: np.ndarray,
    kept: list[list[np.ndarray]],
    steps: np.ndarray,
    radius: np.ndarray,
    layer: int,
    shift: int,
) -> LayerPredictor:
    """Layer ``layer``'s integer predictor at a level: ``weights`` the file's ``P[layer]``
    [2, 2C, T], ``kept`` / ``steps`` / ``radius`` the level's per (layer, K/V) kept components,
    steps [L, 2, C] and radii [L, 2, C]. ``CodecError`` when a sum could leave float32's exact
    range."""
    C, T = weights.shape[1] // 2, weights.shape[2]
    below = [kept[layer - 1][0], kept[layer - 1][1]]
    rows = np.concatenate([below[0], C + below[1]])
    source_steps = np.concatenate([steps[layer - 1, k][below[k]] for k in (0, 1)])
    source_radius = np.concatenate([radius[layer - 1, k][below[k]] for k in (0, 1)])
    parts, counts = [], []
    for k in (0, 1):
        chosen = layer_selection(kept[layer][k], T)
        counts.append(len(chosen))
        part = weights[k][np.ix_(rows, chosen)]
        parts.append(integer_matrix(part, source_steps, steps[layer, k][chosen], shift))
    matrix = np.concatenate(parts, axis=1)
    if exact_bound(matrix, source_radius, shift) >= EXACT_LIMIT:
        raise CodecError(
            f"the tcq model file's predictor of layer {layer} can leave float32's exact range "
            "at this level: the file is corrupt; delete it and copy or refit it"
        )
    return LayerPredictor(
        matrix.astype(np.float32), shift, (len(below[0]), len(below[1])), tuple(counts)
    )


def largest_shift(
    weights: np.ndarray,
    kept: list[list[np.ndarray]],
    steps: np.ndarray,
    radius: np.ndarray,
    layer: int,
    most: int,
) -> int:
    """The largest shift up to ``most`` whose integer predictor keeps every sum exact (the
    fitter's choice; 0 when none does)."""
    for shift in range(most, 0, -1):
        try:
            layer_predictor(weights, kept, steps, radius, layer, shift)
        except CodecError:
            continue
        return shift
    return 0


def residual_symbols(
    predicted: list[tuple[int, LayerPredictor]],
    radius: list[np.ndarray],
    symbols: list[np.ndarray],
    offsets: list[np.ndarray],
) -> list[np.ndarray]:
    """A frame's coded symbols: ``symbols`` (per stream of the frame, (layer, K/V) order, uint8
    [kept, tokens], centred symbol plus radius) with the targets of every ``predicted`` layer
    position replaced by their wrapped residuals (:func:`apply_predictions`). ``radius`` and
    ``offsets``: per stream."""
    kept = np.array([len(r) for r in radius], dtype=np.int64)
    tokens = max((sym.shape[1] for sym in symbols), default=0)
    values = np.zeros((len(symbols), tokens, max(1, int(kept.max(initial=0)))), np.float32)
    for s, (sym, r) in enumerate(zip(symbols, radius)):
        values[s, :, : kept[s]] = sym.T.astype(np.float32) - r.astype(np.float32)
    first = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
    flat_radius = np.concatenate([np.zeros(0, np.int64), *radius]).astype(np.int64)
    flat_offsets = np.concatenate([np.zeros(0, np.int8), *offsets]).astype(np.int8)
    apply_predictions(predicted, values, flat_radius, first, flat_offsets, -1)
    return [(values[s, :, : kept[s]].T + r[:, None]).astype(np.uint8) for s, r in enumerate(radius)]


def apply_predictions(
    predicted: list[tuple[int, LayerPredictor]],
    values: np.ndarray,
    radius: np.ndarray,
    first: np.ndarray,
    offsets: np.ndarray,
    sign: int,
) -> None:
    """Add (``sign`` 1: the decoder, restoring symbols) or subtract (-1: the encoder, making
    residuals) every ``predicted`` layer position's guesses to its targets in ``values``
    [streams, tokens, width] (float32 centred symbols; stream ``s``'s kept components in
    ``[:, :kept]``), wrapping them into their alphabets, in place. ``radius`` and ``offsets``
    hold every kept component's radius and frame offset, stream ``s``'s from ``first[s]``.
    Each guess reads the layer before it unpredicted: the decoder goes up the layers (that
    layer restored already), the encoder down (not made a residual yet)."""
    order = predicted if sign > 0 else predicted[::-1]
    for i, predictor in order:
        below = 2 * (i - 1)
        count = sum(predictor.sources)
        sources = np.empty((values.shape[1], count), dtype=np.float32)
        gather_sources(values, below, predictor.sources[0], predictor.sources[1], offsets,
                       first, sources)  # fmt: skip
        totals = torch.empty((len(sources), predictor.matrix.shape[1]))
        torch.mm(torch.from_numpy(sources), torch.from_numpy(predictor.matrix), out=totals)
        totals = totals.numpy()
        column = 0
        for k in (0, 1):
            stream, n = 2 * i + k, predictor.targets[k]
            add_guesses(values, totals, stream, column, n, radius, offsets, first[stream],
                        predictor.shift, sign)  # fmt: skip
            column += n


@numba.njit(nogil=True, cache=True, boundscheck=False)
def gather_sources(values, below, keys, kept_values, offsets, first, out):
    """``out`` [tokens, keys + kept_values] = ``4 q + o`` of stream ``below``'s first ``keys``
    components, then stream ``below + 1``'s first ``kept_values``."""
    for t in range(values.shape[1]):
        for j in range(keys):
            out[t, j] = 4 * values[below, t, j] + offsets[first[below] + j]
        for j in range(kept_values):
            out[t, keys + j] = 4 * values[below + 1, t, j] + offsets[first[below + 1] + j]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def add_guesses(values, totals, stream, column, count, radius, offsets, at, shift, sign):
    """Stream ``stream``'s first ``count`` components (kept components ``at`` on) plus
    ``sign`` times their guesses (``totals`` columns ``column`` on: ``round_half_even((total -
    o * 2**shift) / 2**(shift + 2))``), wrapped into ``[-r, r]``, in place. Exact: every
    quantity is an integer below 2**24."""
    lift = np.float32(2.0**shift)
    scale = np.float32(2.0 ** -(shift + QUARTER))
    for c in range(count):
        r = radius[at + c]
        span = 2 * r + 1
        lifted = np.float32(offsets[at + c]) * lift
        for t in range(values.shape[1]):
            guess = np.rint((totals[t, column + c] - lifted) * scale)
            z = np.int64(values[stream, t, c] + sign * guess) + r
            if z < 0 or z >= span:  # the guess left the alphabet: wrap (a division, seldom)
                z %= span
            values[stream, t, c] = np.float32(z - r)
