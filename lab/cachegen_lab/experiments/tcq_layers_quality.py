"""Perplexity of the layered tcq stream's prefixes beside the dedicated levels they stand for.

:mod:`cachegen_lab.experiments.tcq_layers` measures bits and a distortion proxy; this module
decodes the KV each prefix stands for and scores it with ``cachegen eval``'s own evaluation
(:func:`cachegen_lab.quality.evaluate.evaluate`). No bitstream is written: every candidate,
the dedicated levels included, is decoded the same way in the lab (coefficients, synthesis,
keys turned back; no refined sink rows, no cross-layer prediction) and counted the same way
(plug-in entropy of each component's symbols per frame), so the table compares layouts and
nothing else.

A prefix of the embedded stream refines, in every frame, the components whose refinement
removes at least a given distortion per bit (its *slope*). The slope of each prefix is chosen
on windows of pydoc's ``calibrate`` split, where the prefix costs what the dedicated level
it stands for costs there; the held-out windows then show its bits and perplexity. Beside
them, prefixes that refine by the base's cell rather than by component: every component's
zero cells, or every component's other cells, so that no component's step changes against
another's."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from cachegen.codec.tcq import model as tcq_model
from cachegen.codec.tcq.code import exact_count, level_code
from cachegen.codec.transform.rotary import rotate_layer_keys
from cachegen.kv import KVCache
from cachegen_lab.experiments import tcq_layers
from cachegen_lab.experiments.tcq_redundancy import stream_rows

# (layer, kind, rows [tokens, C]) -> coefficients of every component [C, tokens], bits
StreamCode = Callable[[int, int, torch.Tensor], tuple[np.ndarray, float]]


class Simulation:
    """Decode a KV as a dedicated level or as an embedded prefix would, frame by frame."""

    def __init__(self, tcq: tcq_model.TcqModel, top: int, base: str = "dead-zone") -> None:
        self.tcq, self.top, self.base = tcq, top, tcq_layers.BASES[base]

    def dedicated(self, kv: KVCache, level: int) -> tuple[KVCache, float]:
        code = level_code(self.tcq, level)

        def stream(layer: int, kind: int, rows: torch.Tensor) -> tuple[np.ndarray, float]:
            sym, q, offset, _ = tcq_layers.centred_symbols(self.tcq, code, layer, kind, rows)
            bits = float(tcq_layers.entropy_bits(sym).sum())
            kept = code.kept[layer][kind]
            return tcq_layers.decoded_coefficients(
                self.tcq, level, layer, kind, kept, q, offset
            ), bits

        return self._decoded(kv, stream)

    def embedded(self, kv: KVCache, slope: float | None, side_bits: int) -> tuple[KVCache, float]:
        """The prefix that refines every component whose slope is at least ``slope`` (None:
        every component, the whole stream); each frame's kept components name their layer in
        ``side_bits`` bits each."""

        def prefix(q, coarse, middle, y) -> tuple[np.ndarray, float]:
            gain_bits, gain_error = refinement_gains(y, q, coarse, middle)
            refined = slope is None or tcq_layers.slope_of(gain_bits, gain_error) >= slope
            bits = float(tcq_layers.entropy_bits(coarse).sum())
            bits += float((gain_bits * refined).sum()) + side_bits * len(q)
            return np.where(np.reshape(refined, (-1, 1)), q, middle), bits

        return self._top_prefix(kv, prefix)

    def cells_refined(self, kv: KVCache, cells: str) -> tuple[KVCache, float]:
        """The prefix that refines, in every component alike, the base's zero cells
        (``cells`` "zero"), its other cells ("outer") or none ("none": the base alone), with
        no side information (one rule for every frame)."""

        def prefix(q, coarse, middle, y) -> tuple[np.ndarray, float]:
            refined = {"zero": coarse == 0, "outer": coarse != 0, "none": False}[cells]
            # each token's symbol names its base cell and, where refined, its top cell
            bits = float(tcq_layers.entropy_bits(np.where(refined, 2 * q, 2 * coarse + 1)).sum())
            return np.where(refined, q, middle), bits

        return self._top_prefix(kv, prefix)

    def _top_prefix(self, kv: KVCache, prefix: Callable) -> tuple[KVCache, float]:
        """``kv`` decoded as a prefix of the top level's stream: ``prefix(q, coarse, middle,
        y)`` gives, from a stream's centred top symbols, their base's symbols and middles and
        the coefficients, the values [kept, tokens] the prefix decodes to and its bits."""
        code = level_code(self.tcq, self.top)

        def stream(layer: int, kind: int, rows: torch.Tensor) -> tuple[np.ndarray, float]:
            _, q, offset, y = tcq_layers.centred_symbols(self.tcq, code, layer, kind, rows)
            values, bits = prefix(q, *self.base(q), y)
            kept = code.kept[layer][kind]
            decoded = tcq_layers.decoded_coefficients(
                self.tcq, self.top, layer, kind, kept, values, offset
            )
            return decoded, bits

        return self._decoded(kv, stream)

    def _decoded(self, kv: KVCache, stream: StreamCode) -> tuple[KVCache, float]:
        parts, bits = [], 0.0
        for chunk in kv.chunks(tcq_layers.FRAME_TOKENS):
            part, frame_bits = self._frame(chunk, stream)
            parts.append(part)
            bits += frame_bits
        return KVCache.concat(parts), bits

    def _frame(self, chunk: KVCache, stream: StreamCode) -> tuple[KVCache, float]:
        tcq = self.tcq
        rows = torch.from_numpy(stream_rows(tcq, chunk))  # [L, 2, m, C]
        L, _, m, C = rows.shape
        out, bits = torch.empty_like(rows), 0.0
        for layer in range(L):
            for kind in range(2):
                coefficients, stream_bits = stream(layer, kind, rows[layer, kind])
                synthesis = coefficients.T @ tcq.components[layer, kind] + tcq.mean[layer, kind]
                out[layer, kind] = torch.from_numpy(synthesis.astype(np.float32))
                bits += stream_bits
        H, D = chunk.keys.shape[1], chunk.keys.shape[3]
        x = out.reshape(L, 2, m, H, D).permute(1, 0, 3, 2, 4).contiguous()
        e = exact_count(chunk.start, chunk.num_tokens)
        thetas = tuple(tcq.rope_thetas[i] for i in chunk.layer_indices)
        if any(thetas):
            x[0] = rotate_layer_keys(x[0], chunk.start + e, thetas)
        keys = torch.cat([chunk.keys[:, :, :e], x[0].to(chunk.keys.dtype)], dim=2)
        values = torch.cat([chunk.values[:, :, :e], x[1].to(chunk.values.dtype)], dim=2)
        exact_bits = 8 * chunk.keys.element_size() * 2 * chunk.keys[:, :, :e].numel()
        return KVCache(keys, values, chunk.token_ids, chunk.model, chunk.start), bits + exact_bits


def refinement_gains(y, q, coarse, middle) -> tuple[np.ndarray, np.ndarray]:
    """Per kept component: the bits its refinement costs (the top level's entropy less the
    base's) and the squared error it removes, in the top level's steps, of coefficients ``y``
    (in steps, less the offsets) coded as ``q`` against their base's ``middle``."""
    gain_bits = tcq_layers.entropy_bits(q) - tcq_layers.entropy_bits(coarse)
    gain_error = ((y - middle) ** 2).sum(axis=1) - ((y - q) ** 2).sum(axis=1)
    return np.maximum(gain_bits, 0.0), gain_error


def slopes_for(sums: tcq_layers.Sums, targets: dict[int, float], side_bits: int) -> dict:
    """For each level, the slope at which the embedded prefix costs ``targets[level]`` bits
    per element on the frames of ``sums`` (the calibration windows)."""
    refinements = tcq_layers.Refinements.of(sums)
    spent = refinements.spent(sums, side_bits)[1:]  # after each refinement
    slopes = refinements.slope[refinements.order]
    out = {}
    for level, bits in targets.items():
        at = int(np.searchsorted(spent, bits * sums.elements))
        out[level] = float(slopes[min(at, len(slopes) - 1)])
    return out


def candidates(simulation: Simulation, levels: list[int], slopes: dict, side_bits: int) -> list:
    """``cachegen eval`` candidates: each dedicated level, and the embedded stream's prefix
    standing for each level of ``slopes``, its whole stream, its base, and the prefixes that
    refine the base's zero cells or its other cells in every component."""
    from cachegen_lab.quality.evaluate import Candidate

    out = [
        Candidate("dedicated", str(level), lambda kv, v=level: simulation.dedicated(kv, v))
        for level in levels
    ]
    for level, slope in slopes.items():
        out.append(
            Candidate(
                "embedded",
                f"as {level}",
                lambda kv, s=slope: simulation.embedded(kv, s, side_bits),
                {"slope": slope},
            )
        )
    out.append(Candidate("embedded", "whole", lambda kv: simulation.embedded(kv, None, side_bits)))
    for cells, name in (("none", "base"), ("zero", "zero cells"), ("outer", "outer cells")):
        out.append(Candidate("embedded", name, lambda kv, c=cells: simulation.cells_refined(kv, c)))
    return out
