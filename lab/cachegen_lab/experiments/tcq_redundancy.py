"""What redundancy the ``tcq`` codec leaves in its symbols, and where a next coder could find it.

tcq codes each kept component of a (layer, K/V) stream with its own table, every symbol on
its own. This lab measures, on held-out windows, the empirical entropy of a level's quantized
coefficients (bits per element of the stream, the dropped components counting 0) under four
models of them:

* ``independent``: each component on its own (what one table per component can reach);
* ``previous_token``: each symbol given the size class (0, 1, 2 or more) of the same
  component's symbol one token earlier;
* ``token_loudness``: each symbol given the size class of its token's mean absolute symbol
  over the components coded before its group of ``rans.LANES`` (what a decoder that goes
  group by group knows);
* ``previous_layer`` (one per ``--sources``): the residual after a linear prediction from
  the previous layer's *quantized* keys and values coefficients (its first ``sources``
  components of each, or all of them), the prediction fitted by ridge regression on windows
  of the ``calibrate`` split (never on the measured text).

The quantizer is the level's (``round(y / step)``, no per-frame offset, no clipping), so the
measures differ only in what each symbol is conditioned on; the entropies are plug-in
estimates over all windows' tokens (the first ``tcq_code.EXACT_TOKENS`` of each window are
exact in the codec and left out). Run::

    cachegen experiment tcq-redundancy --model smollm2-135m --level 22 \\
        --dataset prose,code --windows 16 --fit-windows 16 --json OUT.json
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from cachegen.codec.base import kv_tensor
from cachegen.codec.coding import rans
from cachegen.codec.tcq import code as tcq_code
from cachegen.codec.tcq import model as tcq_model
from cachegen.codec.transform.rotary import rotate_layer_keys
from cachegen.errors import InputError
from cachegen.fileio import versioned
from cachegen.kv import KVCache

SCHEMA = "cachegen-tcq-redundancy"
VERSION = 1
RIDGE = 1e-2  # ridge penalty, relative to the mean diagonal of the sources' Gram matrix
SIZE_CLASSES = 3  # |symbol| 0, 1, >= 2
LOUDNESS_EDGES = (0.25, 0.5, 1.0)  # mean |symbol| of a token's earlier components


def coefficients(model: tcq_model.TcqModel, kv: KVCache) -> np.ndarray:
    """The PCA coefficients [L, 2, tokens, C] (float32, unscaled) of ``kv``'s tokens past the
    exact ones, as tcq's encoder computes them (keys turned back to their pre-RoPE form)."""
    layers = list(kv.layer_indices)
    mean = model.mean[layers][:, :, None, :]
    rows = stream_rows(model, kv)
    return np.einsum("lktc,lkic->lkti", rows - mean, model.components[layers], optimize=True)


def stream_rows(model: tcq_model.TcqModel, kv: KVCache) -> np.ndarray:
    """The rows [L, 2, tokens, channels] (float32) that tcq's encoder codes of ``kv``'s tokens
    past its exact ones: keys turned back to their pre-RoPE form, heads side by side."""
    e = tcq_code.exact_count(kv.start, kv.num_tokens)
    x = kv_tensor(kv)[:, :, :, e:].to(torch.float32)
    layers = list(kv.layer_indices)
    thetas = tuple(model.rope_thetas[i] for i in layers)
    if any(thetas):
        x[0] = rotate_layer_keys(x[0], kv.start + e, thetas, inverse=True)
    _, L, H, m, D = x.shape
    return x.permute(1, 0, 3, 2, 4).reshape(L, 2, m, H * D).numpy()


def quantized(model: tcq_model.TcqModel, level: int, y: np.ndarray) -> np.ndarray:
    """Symbols [L, 2, tokens, C] (int16; 0 for dropped components) of coefficients ``y`` at
    ``level`` (``y``'s layers: all the model's)."""
    index = list(model.levels).index(level)
    steps = model.steps[index][:, :, None, :]
    kept = model.radius[index][:, :, None, :] > 0
    return np.where(kept, np.round(y / steps), 0).astype(np.int16)


def _sources(sym: np.ndarray, steps: np.ndarray, layer: int, count: int | None) -> np.ndarray:
    """The predictor's inputs for ``layer``: layer ``layer - 1``'s dequantized keys and values
    coefficients [tokens, 2 * count] (the first ``count`` components of each; None: all)."""
    parts = [sym[layer - 1, k] * steps[layer - 1, k] for k in (0, 1)]
    return np.concatenate([p[:, :count] for p in parts], axis=1).astype(np.float64)


class PredictorFit:
    """Ridge regression of each stream's coefficients (layer >= 1) on the previous layer's
    dequantized coefficients, from sufficient statistics gathered window by window."""

    def __init__(self, layers: int, channels: int, count: int | None) -> None:
        n = 2 * (channels if count is None else min(count, channels))
        self.count = count
        self.gram = np.zeros((layers, n, n))
        self.cross = np.zeros((layers, 2, n, channels))

    def add(self, y: np.ndarray, sym: np.ndarray, steps: np.ndarray) -> None:
        for layer in range(1, y.shape[0]):
            x = _sources(sym, steps, layer, self.count)
            self.gram[layer] += x.T @ x
            for k in (0, 1):
                self.cross[layer, k] += x.T @ y[layer, k]

    def solve(self) -> np.ndarray:
        """Prediction matrices [L, 2, sources, C] (layer 0: zero, it has no previous layer)."""
        out = np.zeros_like(self.cross)
        n = self.gram.shape[-1]
        for layer in range(1, self.gram.shape[0]):
            gram = self.gram[layer]
            penalty = RIDGE * np.trace(gram) / n
            for k in (0, 1):
                out[layer, k] = np.linalg.solve(gram + penalty * np.eye(n), self.cross[layer, k])
        return out


def _entropy_bits(symbols: np.ndarray, context: np.ndarray | None = None) -> float:
    """Plug-in entropy in bits, summed over ``symbols``' rows [tokens, components] (each
    column its own source), of each symbol given its ``context`` (same shape, small ints)."""
    tokens, components = symbols.shape
    shift = symbols - symbols.min()
    width = int(shift.max()) + 1
    ctx = np.zeros_like(shift) if context is None else context
    classes = int(ctx.max()) + 1
    cell = (np.arange(components)[None, :] * classes + ctx) * width + shift
    counts = np.bincount(cell.ravel(), minlength=components * classes * width)
    counts = counts.reshape(components * classes, width).astype(np.float64)
    totals = counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(counts > 0, counts * np.log2(totals / np.where(counts > 0, counts, 1)), 0)
    return float(terms.sum())


def previous_token_context(sym: np.ndarray) -> np.ndarray:
    """Size class of the same component's symbol one token earlier (0 for the first token)."""
    size = np.minimum(np.abs(sym), SIZE_CLASSES - 1)
    return np.concatenate([np.zeros_like(size[:1]), size[:-1]], axis=0)


def loudness_context(sym: np.ndarray) -> np.ndarray:
    """Class of a token's mean |symbol| over the components of the groups before each
    component's group (group 0: class 0)."""
    tokens, components = sym.shape
    cum = np.cumsum(np.abs(sym), axis=1)
    out = np.zeros_like(sym)
    for g in range(rans.LANES, components, rans.LANES):
        out[:, g : g + rans.LANES] = np.digitize(cum[:, g - 1] / g, LOUDNESS_EDGES)[:, None]
    return out


def fit_predictors(
    model: tcq_model.TcqModel, level: int, kvs, sources: list[int | None], progress: bool = False
) -> list[np.ndarray]:
    """One prediction matrix set per ``sources`` entry, fitted on ``kvs`` (full-model
    :class:`KVCache` of the calibration text)."""
    index = list(model.levels).index(level)
    steps = model.steps[index]
    L, _, C = steps.shape
    fits = [PredictorFit(L, C, count) for count in sources]
    for kv in tqdm(kvs, desc="fit", disable=not progress):
        y = coefficients(model, kv)
        sym = quantized(model, level, y)
        for fit in fits:
            fit.add(y, sym, steps)
    return [fit.solve() for fit in fits]


def measure(
    model: tcq_model.TcqModel,
    level: int,
    predictors: list[np.ndarray],
    sources: list[int | None],
    kvs,
    progress: bool = False,
) -> dict:
    """Bits per element of every measure on ``kvs`` (full-model :class:`KVCache`), in total
    and per (layer, K/V); ``predictors`` from :func:`fit_predictors` for ``sources``."""
    index = list(model.levels).index(level)
    steps = model.steps[index][:, :, None, :]
    kept = model.radius[index] > 0
    L, _, C = kept.shape
    names = ["independent", "previous_token", "token_loudness"] + [
        f"previous_layer_{'all' if count is None else count}" for count in sources
    ]
    symbols: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for kv in tqdm(kvs, desc="measure", disable=not progress):
        y = coefficients(model, kv)
        sym = quantized(model, level, y)
        symbols["independent"].append(sym)
        for name, count, weights in zip(names[3:], sources, predictors):
            residual = sym.copy()
            for layer in range(1, L):
                x = _sources(sym, steps[:, :, 0], layer, count)
                for k in (0, 1):
                    guess = x @ weights[layer, k]
                    q = np.round((y[layer, k] - guess) / steps[layer, k])
                    residual[layer, k] = np.where(kept[layer, k], q, 0)
            symbols[name].append(residual)
    bits = {name: np.zeros((L, 2)) for name in names}
    # contexts are taken window by window: a window's first token has no previous token
    contexts = {"previous_token": previous_token_context, "token_loudness": loudness_context}
    tokens = 0
    for name in ["independent", *names[3:]]:
        joined = np.concatenate(symbols[name], axis=2)
        tokens = joined.shape[2]
        for layer in range(L):
            for k in (0, 1):
                cols = joined[layer, k][:, kept[layer, k]]
                if not cols.size:
                    continue
                bits[name][layer, k] = _entropy_bits(cols)
                if name != "independent":
                    continue
                for ctx_name, context_of in contexts.items():
                    ctx = np.concatenate([context_of(s[layer, k]) for s in symbols[name]])
                    bits[ctx_name][layer, k] = _entropy_bits(cols, ctx[:, kept[layer, k]])
    elements = max(tokens * C, 1)
    return {
        "tokens": tokens,
        "bits_per_element": {name: float(b.sum() / (elements * 2 * L)) for name, b in bits.items()},
        "layer_bits_per_element": {
            name: (b / elements).round(4).tolist() for name, b in bits.items()
        },
    }


def run(
    model: str,
    level: int,
    datasets: list[str],
    windows: int,
    fit_windows: int,
    context_tokens: int,
    sources: list[int | None],
    seed: int,
    command: str,
    progress: bool = True,
) -> dict:
    from cachegen.extract import extract_kv, load_model
    from cachegen.fitting.tcq import ensure_tcq_model
    from cachegen_lab.quality.datasets import DataSettings, load_windows

    _, tokenizer, spec = load_model(model)
    fit_data = DataSettings("pydoc", fit_windows, context_tokens, 1, seed=seed, split="calibrate")
    data = [DataSettings(d, windows, context_tokens, 1, seed=seed) for d in datasets]
    fit_texts = load_windows(fit_data, tokenizer, spec.max_positions)
    texts_of = [load_windows(one, tokenizer, spec.max_positions) for one in data]
    fitted = ensure_tcq_model(spec)
    if level not in fitted.levels:
        raise InputError(f"--level must be one of {', '.join(map(str, fitted.levels))}")

    def kvs(texts):
        return (extract_kv(spec, token_ids=w.context_ids) for w in texts)

    predictors = fit_predictors(fitted, level, kvs(fit_texts), sources, progress)
    rows = []
    for settings, texts in zip(data, texts_of):
        found = measure(fitted, level, predictors, sources, kvs(texts), progress)
        rows.append({"dataset": settings.dataset, "data": settings.describe(), **found})
    return versioned(
        SCHEMA,
        VERSION,
        {
            "command": command,
            "model": spec.name,
            "model_file": fitted.id,
            "level": level,
            "fit_data": fit_data.describe(),
            "fit_windows": fit_windows,
            "windows": windows,
            "bits_per_element": "plug-in entropy of the level's symbols per element of the "
            "streams (dropped components count 0), under each measure",
            "rows": rows,
        },
    )


def table(doc: dict) -> str:
    names = list(doc["rows"][0]["bits_per_element"]) if doc["rows"] else []
    lines = [f"{'dataset':<9}" + "".join(f"{n:>22}" for n in names)]
    for row in doc["rows"]:
        base = row["bits_per_element"]["independent"]
        cells = [
            f"{v:.4f} ({100 * (v / base - 1):+.1f}%)" if base else f"{v:.4f}"
            for v in row["bits_per_element"].values()
        ]
        lines.append(f"{row['dataset']:<9}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)
