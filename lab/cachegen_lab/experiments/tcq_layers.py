"""What one layered ``tcq`` stream per chunk would cost: prefixes that decode at coarser quality.

A stored chunk whose byte prefixes decode to coarser levels would let one stored form serve
every link rate. This lab measures two ways to build such a stream from a level's symbols, on
windows of a split, against the dedicated levels (each coded on its own), before any of them
is written as a codec:

* ``exact``: prefixes that decode to dedicated levels exactly (a ladder of levels, each
  coded given the coarser ones). Its bits at a level are the joint entropy of that level's
  symbols and the coarser ones', which exceeds the level's own wherever a finer cell straddles
  a coarser cell's edge.
* ``embedded``: one top level's symbols ``q``, a base layer that merges their cells (its
  layout, :data:`BASES`: the dead-zone coarsening ``sign(q) * (|q| >> 1)``, cells ``{-1, 0,
  1}``, ``{2, 3}``, ``{4, 5}``, ...: a wider zero cell; or the triple step, cells ``{-1, 0,
  1}``, ``{2, 3, 4}``, ...: a uniform grid of three times the top step; either decoded at each
  cell's middle), and refinement layers that restore ``q`` component by
  component, the components of each frame in the order of the distortion their refinement
  removes per bit it costs (one slope for all frames, as an encoder aiming at a size would
  choose). Every prefix then decodes a quantizer whose cells are unions of the top level's,
  so refining costs no more than the top level's own symbols. Each frame names which layer
  refines each of its components (``ceil(log2(layers + 1))`` bits per kept component, counted
  in the base).

Bits are plug-in entropies of each component's symbols over a frame (what per-frame tables
reach; the codec's tables, offsets and exact tokens are left out alike for every row).
Distortion is the squared error of the coefficients of all components in units of the top
level's step of each component (the codec's output-tracking weights: keys' effect on the
attention logits, values' on the output projection), per element. It is a proxy: a layout
chosen here must still show its perplexity change through ``cachegen eval``. Run::

    cachegen experiment tcq-layers --model smollm2-135m --top-level 24 \\
        --dataset pydoc --split calibrate --windows 4 --json OUT.json
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from cachegen.codec.tcq import encode as tcq_encode
from cachegen.codec.tcq import model as tcq_model
from cachegen.codec.tcq.code import OFFSET_UNITS, level_code
from cachegen.errors import InputError
from cachegen.fileio import versioned
from cachegen_lab.experiments.tcq_redundancy import stream_rows

SCHEMA = "cachegen-tcq-layers"
VERSION = 2  # 2 added the base layout ("base"); version 1 documents are "dead-zone"
FRAME_TOKENS = 256  # the connector's chunk: one frame per stored record


def entropy_bits(sym: np.ndarray) -> np.ndarray:
    """Plug-in entropy in bits of each row of ``sym`` [rows, tokens] (ints):
    ``-sum(count * log2(count / tokens))``."""
    rows, _ = sym.shape
    if not sym.size:
        return np.zeros(rows)
    values = sym.astype(np.int64) - int(sym.min())
    width = int(values.max()) + 1
    unique, counts = np.unique(np.arange(rows)[:, None] * width + values, return_counts=True)
    bits = -counts * np.log2(counts / sym.shape[1])
    return np.bincount(unique // width, weights=bits, minlength=rows)


def dead_zone(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The base layer of centred symbols ``q``: its symbols ``sign(q) * (|q| >> 1)`` and what
    they decode to, each cell's middle (0 for the zero cell ``{-1, 0, 1}``, ``2a + 0.5``
    for the cell ``{2a, 2a + 1}``)."""
    cell = np.abs(q) >> 1
    middle = np.where(cell > 0, 2 * cell + 0.5, 0.0)
    return np.sign(q) * cell, np.sign(q) * middle


def triple_step(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The base layer of centred symbols ``q`` on a uniform grid of three times the top
    level's step: its symbols ``sign(q) * ((|q| + 1) // 3)`` (cells ``{-1, 0, 1}``,
    ``{2, 3, 4}``, ``{5, 6, 7}``, ...: every cell as wide as the zero cell, so no more
    shrinkage than a dedicated level's) and what they decode to, each cell's middle ``3 *``
    its symbol. Three is the smallest ratio at which a grid centred on 0 nests in a finer
    one."""
    coarse = np.sign(q) * ((np.abs(q) + 1) // 3)
    return coarse, 3.0 * coarse


# the base layouts a layered stream may refine from: name -> (q -> base symbols, middles)
BASES = {"dead-zone": dead_zone, "triple-step": triple_step}


@dataclass
class Sums:
    """Bits and distortion summed over frames: per dedicated level, per ``exact`` ladder
    boundary, and the embedded stream's per-component rows."""

    elements: int = 0
    frames: int = 0
    kept_top: int = 0  # kept components of the top level, summed over frames
    dedicated: dict[int, list[float]] = field(default_factory=dict)
    exact: dict[int, float] = field(default_factory=dict)
    dropped_error: float = 0.0  # error of the top level's dropped components (every prefix)
    components: list[np.ndarray] = field(default_factory=list)  # [4, kept]: bits/error pairs

    def add(self, key, table: dict, bits: float, error: float | None = None) -> None:
        if error is None:
            table[key] = table.get(key, 0.0) + bits
            return
        pair = table.setdefault(key, [0.0, 0.0])
        pair[0] += bits
        pair[1] += error


class FrameMeasure:
    """One frame's coefficients against a model file's levels."""

    def __init__(
        self, tcq: tcq_model.TcqModel, levels: list[int], top: int, base: str = "dead-zone"
    ) -> None:
        self.tcq, self.levels, self.top, self.base = tcq, levels, top, BASES[base]
        self.codes = {level: level_code(tcq, level) for level in levels}

    def measure(self, rows: np.ndarray, sums: Sums, ladder: list[int]) -> None:
        """Add frame ``rows`` [L, 2, tokens, C] (float32 pre-RoPE keys and values of every
        layer) to ``sums``."""
        L, _, m, _ = rows.shape
        sums.frames += 1
        sums.elements += rows.size
        for layer in range(L):
            for kind in range(2):
                self._stream(layer, kind, torch.from_numpy(rows[layer, kind]), sums, ladder)

    def _stream(self, layer: int, kind: int, rows: torch.Tensor, sums: Sums, ladder) -> None:
        tcq = self.tcq
        full = tcq.components[layer, kind] @ (rows.numpy() - tcq.mean[layer, kind]).T
        unit = tcq.steps[tcq.level_index(self.top), layer, kind]  # [C]
        symbols = {}
        for level in self.levels:
            code = self.codes[level]
            kept = code.kept[layer][kind]
            sym, q, offset, _ = centred_symbols(tcq, code, layer, kind, rows)
            symbols[level] = (kept, q, offset)
            decoded = decoded_coefficients(tcq, level, layer, kind, kept, q, offset)
            error = weighted_error(full, decoded, unit)
            sums.add(level, sums.dedicated, float(entropy_bits(sym).sum()), error)
        for depth in range(1, len(ladder) + 1):
            joint = _joint([symbols[level] for level in ladder[:depth]], full.shape)
            sums.add(ladder[depth - 1], sums.exact, float(entropy_bits(joint).sum()))
        self._embedded(layer, kind, full, unit, symbols[self.top], sums)

    def _embedded(self, layer, kind, full, unit, top_symbols, sums: Sums) -> None:
        kept, q, offset = top_symbols
        coarse, middle = self.base(q)
        fine = decoded_coefficients(self.tcq, self.top, layer, kind, kept, q, offset)
        base = decoded_coefficients(self.tcq, self.top, layer, kind, kept, middle, offset)
        dropped = np.setdiff1d(np.arange(len(unit)), kept)
        sums.dropped_error += weighted_error(full[dropped], 0 * full[dropped], unit[dropped])
        scale = unit[kept, None]
        sums.kept_top += len(kept)
        sums.components.append(
            np.stack(
                [
                    entropy_bits(coarse),
                    (((full[kept] - base[kept]) / scale) ** 2).sum(axis=1),
                    entropy_bits(q),
                    (((full[kept] - fine[kept]) / scale) ** 2).sum(axis=1),
                ]
            )
        )


def centred_symbols(tcq, code, layer: int, kind: int, rows: torch.Tensor) -> tuple:
    """:func:`cachegen.codec.tcq.encode.quantize_rows` of (``layer``, ``kind``)'s ``rows`` at the
    level of ``code``, centred: (symbols, the same centred on 0 as int64, offsets, coefficients
    in steps less the offsets)."""
    sym, offset, y = tcq_encode.quantize_rows(tcq, code, layer, kind, rows, True)
    return sym, sym.astype(np.int64) - code.radius[layer][kind][:, None], offset, y


def decoded_coefficients(tcq, level, layer, kind, kept, values, offset) -> np.ndarray:
    """Coefficients [C, tokens] of every component of (``layer``, ``kind``) that level
    ``level``'s kept components ``kept`` decode to from ``values`` [kept, tokens] (in steps)
    and ``offset`` [kept] (in 1 / OFFSET_UNITS steps); 0 for the dropped ones."""
    step = tcq.steps[tcq.level_index(level), layer, kind]
    out = np.zeros((len(step), values.shape[1]))
    out[kept] = (values + offset[:, None] / OFFSET_UNITS) * step[kept, None]
    return out


def weighted_error(full: np.ndarray, decoded: np.ndarray, unit: np.ndarray) -> float:
    """Squared error of coefficients ``full`` [C, tokens] decoded as ``decoded``, in units of
    ``unit`` [C] (the top level's steps), over the components that have a step."""
    has = unit > 0
    return float((((full - decoded)[has] / unit[has, None]) ** 2).sum())


def _joint(ladder_symbols: list[tuple], shape) -> np.ndarray:
    """One symbol per (component, token) naming the tuple of every ladder level's symbols
    (0 where a level drops the component), as a non-negative int64 array [C, tokens]."""
    joint = np.zeros(shape, dtype=np.int64)
    for kept, q, _ in ladder_symbols:
        values = np.zeros(shape, dtype=np.int64)
        values[kept] = q + 256
        joint = joint * 512 + values
    return joint


def slope_of(gain_bits: np.ndarray, gain_error: np.ndarray) -> np.ndarray:
    """Distortion a refinement removes per bit it costs (a free one ranks first)."""
    return gain_error / np.maximum(gain_bits, 1e-12)


@dataclass
class Refinements:
    """The embedded stream's refinements over the frames of a :class:`Sums`: each kept
    component's base bits and error, the bits and error its refinement costs and removes,
    its slope, and the order a prefix takes them in (falling slope)."""

    base_bits: np.ndarray
    base_error: np.ndarray
    gain_bits: np.ndarray
    gain_error: np.ndarray
    slope: np.ndarray
    order: np.ndarray

    @classmethod
    def of(cls, sums: Sums) -> Refinements:
        rows = np.concatenate(sums.components, axis=1)
        gain_bits = np.maximum(rows[2] - rows[0], 0.0)
        gain_error = rows[1] - rows[3]
        slope = slope_of(gain_bits, gain_error)
        order = np.argsort(-slope, kind="stable")
        return cls(rows[0], rows[1], gain_bits, gain_error, slope, order)

    def spent(self, sums: Sums, side: int) -> np.ndarray:
        """Bits, summed over the frames, of the base (each kept component's layer in
        ``side`` bits) and of each prefix that takes one more refinement."""
        base = self.base_bits.sum() + side * sums.kept_top
        return base + np.concatenate([[0.0], np.cumsum(self.gain_bits[self.order])])


def embedded_curve(sums: Sums, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bits and distortion, both summed over the frames, of the embedded stream's prefixes
    from its base to its top, components refined in falling order of distortion removed per
    bit; the base carries each kept component's layer in ``side`` bits."""
    refinements = Refinements.of(sums)
    removed = np.concatenate([[0.0], np.cumsum(refinements.gain_error[refinements.order])])
    error = sums.dropped_error + refinements.base_error.sum() - removed
    return refinements.spent(sums, side), error


def intermediate_levels(sums: Sums, top: int) -> dict[int, float]:
    """The dedicated levels below ``top`` that cost more than the embedded base, each with its
    bits per element: the prefixes a stream would offer between base and top."""
    n = sums.elements
    base = sum(float(rows[0].sum()) for rows in sums.components) / n
    return {
        level: bits / n
        for level, (bits, _) in sorted(sums.dedicated.items())
        if level < top and bits / n > base
    }


def side_bits(prefixes: int) -> int:
    """Bits per kept component and frame naming the refinement layer that restores it, with
    ``prefixes`` prefixes between base and top (``prefixes + 1`` refinement layers)."""
    return math.ceil(math.log2(prefixes + 1))


def summary(sums: Sums, top: int, ladder: list[int]) -> dict:
    """Per element: each dedicated level's bits and distortion; the exact ladder's bits at its
    levels; the embedded stream's base and top, and at each dedicated level between them its
    distortion at the level's bits and its bits at the level's distortion."""
    n = sums.elements
    dedicated = {level: (b / n, e / n) for level, (b, e) in sorted(sums.dedicated.items())}
    bits, error = embedded_curve(sums, side_bits(len(intermediate_levels(sums, top))))
    bits, error = bits / n, error / n
    rows = []
    for level, (b, e) in dedicated.items():
        row = {"level": level, "bits_per_element": b, "distortion": e}
        if bits[0] <= b <= bits[-1]:
            row["embedded_distortion_at_bits"] = float(np.interp(b, bits, error))
        if error[-1] <= e <= error[0]:
            same = float(np.interp(-e, -error, bits))
            row["embedded_bits_at_distortion"] = same
            row["embedded_bits_change_pct"] = 100 * (same / b - 1)
        if level in sums.exact:
            exact = sums.exact[level] / n
            row["exact_bits_per_element"] = exact
            row["exact_bits_change_pct"] = 100 * (exact / b - 1)
        rows.append(row)
    return {
        "elements": n,
        "frames": sums.frames,
        "levels": rows,
        "embedded": {
            "base": {"bits_per_element": float(bits[0]), "distortion": float(error[0])},
            "top": {"bits_per_element": float(bits[-1]), "distortion": float(error[-1])},
        },
    }


def run(
    model: str,
    top: int,
    ladder: list[int],
    datasets: list[str],
    windows: int,
    tokens: tuple[int, int],
    split: str,
    seed: int,
    command: str,
    progress: bool = True,
    quality_windows: int = 0,
    base: str = "dead-zone",
) -> dict:
    """``tokens``: context and scored continuation tokens per window; ``base``: the embedded
    stream's base layout, a name of :data:`BASES`."""
    from cachegen.extract import extract_kv, load_model
    from cachegen.fitting.tcq import ensure_tcq_model
    from cachegen_lab.quality.datasets import DataSettings, load_windows

    _, tokenizer, spec = load_model(model)
    fitted = ensure_tcq_model(spec)
    levels = sorted(fitted.levels)
    for level in [top, *ladder]:
        if level not in levels:
            raise InputError(f"tcq levels are {', '.join(map(str, levels))}, not {level}")
    if not ladder or ladder[-1] != top or sorted(ladder) != ladder:
        raise InputError("--ladder must list rising levels that end at --top-level")
    frames = FrameMeasure(fitted, levels, top, base)

    def measured(data: DataSettings) -> tuple[list, Sums]:
        sums = Sums()
        texts = load_windows(data, tokenizer, spec.max_positions)
        for window in tqdm(texts, desc=data.dataset, unit="window", disable=not progress):
            kv = extract_kv(spec, token_ids=window.context_ids)
            for chunk in kv.chunks(FRAME_TOKENS):
                frames.measure(stream_rows(fitted, chunk), sums, ladder)
        return texts, sums

    rows, scored = [], {}
    if quality_windows:
        scored = _calibrated_slopes(measured, fitted, top, quality_windows, tokens[0], seed)
    for dataset in datasets:
        data = DataSettings(dataset, windows, *tokens, seed=seed, split=split)
        texts, sums = measured(data)
        row = {"dataset": dataset, "data": data.describe(), **summary(sums, top, ladder)}
        if scored:
            row["perplexity"] = _scored(spec.name, texts, fitted, (top, base), scored, progress)
        rows.append(row)
    return versioned(
        SCHEMA,
        VERSION,
        {
            "command": command,
            "model": spec.name,
            "model_file": fitted.id,
            "top_level": top,
            "base": base,
            "ladder": ladder,
            "frame_tokens": FRAME_TOKENS,
            "bits_per_element": "plug-in entropy of each component's symbols over a frame",
            "distortion": "squared error of all components' coefficients in the top level's "
            "steps, per element",
            **({"slopes": scored} if scored else {}),
            "rows": rows,
        },
    )


def _calibrated_slopes(measured, fitted, top: int, windows: int, context_tokens: int, seed: int):
    """The slope of each embedded prefix that stands for a level below ``top``, chosen where
    it costs that level's bits on ``windows`` windows of pydoc's calibrate split, with the
    calibration data it was chosen on."""
    from cachegen_lab.experiments import tcq_layers_quality as quality
    from cachegen_lab.quality.datasets import DataSettings

    data = DataSettings("pydoc", windows, context_tokens, 1, seed=seed, split="calibrate")
    _, sums = measured(data)
    targets = intermediate_levels(sums, top)
    side = side_bits(len(targets))
    return {
        "data": data.describe(),
        "side_bits": side,
        "levels": quality.slopes_for(sums, targets, side),
    }


def _scored(model: str, texts, fitted, layout: tuple[int, str], scored: dict, progress):
    from cachegen_lab.experiments import tcq_layers_quality as quality
    from cachegen_lab.quality.evaluate import EvalSettings, evaluate

    top, base = layout
    simulation = quality.Simulation(fitted, top, base)
    slopes = {int(level): slope for level, slope in scored["levels"].items()}
    shown = [level for level in sorted(fitted.levels) if level <= top]
    chosen = quality.candidates(simulation, shown, slopes, scored["side_bits"])
    return evaluate(model, texts, chosen, EvalSettings(gen_windows=0), progress=progress)


def table(doc: dict) -> str:
    lines = []
    for row in doc["rows"]:
        base, top = row["embedded"]["base"], row["embedded"]["top"]
        lines.append(
            f"{row['dataset']}: embedded base {base['bits_per_element']:.3f} b "
            f"(distortion {base['distortion']:.4f}), top {top['bits_per_element']:.3f} b"
        )
        for level in row["levels"]:
            cells = [f"  level {level['level']}: {level['bits_per_element']:.3f} b"]
            cells.append(f"distortion {level['distortion']:.4f}")
            if "embedded_bits_change_pct" in level:
                cells.append(f"embedded {level['embedded_bits_change_pct']:+.1f}% bits")
            if "exact_bits_change_pct" in level:
                cells.append(f"exact {level['exact_bits_change_pct']:+.1f}% bits")
            lines.append(", ".join(cells))
    return "\n".join(lines)
