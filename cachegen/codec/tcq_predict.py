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


def guesses(predictor: LayerPredictor, sources: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    """Each token's guess [tokens, targets] (float32 integers) from ``sources`` [tokens,
    sources] (float32 integers ``4 q + o``) and the targets' ``offsets`` (quarter steps)."""
    total = sources @ torch.from_numpy(predictor.matrix)  # exact: every sum is below 2**24
    total -= torch.from_numpy(offsets.astype(np.float32) * 2.0**predictor.shift)
    return torch.round(total * 2.0 ** -(predictor.shift + QUARTER))


def wrap(values: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """``values`` (float32 integers) wrapped into ``[-radius, radius]`` (per column)."""
    return torch.remainder(values + radius, 2 * radius + 1) - radius


def _sources(values: list, offsets: list, position: int, predictor: LayerPredictor):
    """Layer ``position``'s sources ``4 q + o`` [tokens, sources] (float32) from its key and
    value streams' centred values ``values`` [tokens, kept] and their offsets."""
    parts = [
        values[2 * position + k][:, : predictor.sources[k]] * 4
        + torch.from_numpy(offsets[2 * position + k].astype(np.float32))
        for k in (0, 1)
    ]
    return torch.cat(parts, dim=1)


def _target_offsets(offsets: list, position: int, predictor: LayerPredictor) -> np.ndarray:
    return np.concatenate([offsets[2 * position + k][: predictor.targets[k]] for k in (0, 1)])


def residual_symbols(
    predicted: list[tuple[int, LayerPredictor]],
    radius: list[np.ndarray],
    symbols: list[np.ndarray],
    offsets: list[np.ndarray],
) -> list[np.ndarray]:
    """A frame's coded symbols: ``symbols`` (per stream of the frame, (layer, K/V) order, uint8
    [kept, tokens], centred symbol plus radius) with the targets of every ``predicted`` layer
    position replaced by their wrapped residuals. ``radius`` and ``offsets``: per stream."""
    values = [
        torch.from_numpy(s.T.astype(np.float32) - r.astype(np.float32))
        for s, r in zip(symbols, radius)
    ]
    out = list(symbols)
    for i, predictor in predicted:
        guess = guesses(
            predictor,
            _sources(values, offsets, i - 1, predictor),
            _target_offsets(offsets, i, predictor),
        )
        column = 0
        for k in (0, 1):
            n, s = predictor.targets[k], 2 * i + k
            r = radius[s][:n].astype(np.float32)
            residual = wrap(values[s][:, :n] - guess[:, column : column + n], torch.from_numpy(r))
            coded = symbols[s].copy()
            coded[:n] = (residual.numpy().T + r[:, None]).astype(np.uint8)
            out[s] = coded
            column += n
    return out


def restore_values(
    predicted: list[tuple[int, LayerPredictor]],
    radius: list[torch.Tensor],
    values: list[torch.Tensor],
    offsets: list[np.ndarray],
) -> None:
    """The decoder's inverse of :func:`residual_symbols`, in place: ``values`` (per stream,
    float32 [tokens, kept]: centred symbols, or at the predicted targets wrapped residuals)
    become the centred symbols, layer after layer (each layer's guess reads the layer before
    it, already restored)."""
    for i, predictor in predicted:
        guess = guesses(
            predictor,
            _sources(values, offsets, i - 1, predictor),
            _target_offsets(offsets, i, predictor),
        )
        column = 0
        for k in (0, 1):
            n, s = predictor.targets[k], 2 * i + k
            restored = wrap(values[s][:, :n] + guess[:, column : column + n], radius[s][:n])
            values[s][:, :n] = restored
            column += n
