"""The model's ``tcq`` model (``cachegen.codec.tcq_model``): the KVTC basis, component
weights (:mod:`cachegen.fitting.attention`), and for each level the step that costs its bits
per element on the ``calibrate`` split, with the radii and rANS tables of the calibration
coefficients' histograms."""

from __future__ import annotations

import numpy as np

from cachegen import models
from cachegen.codec import kvtc_basis, rans, tcq_model
from cachegen.codec.profile import locked, profile_path
from cachegen.codec.tcq_code import OFFSET_UNITS
from cachegen.codec.tcq_model import MAX_RADIUS
from cachegen.codec.transform import TransformBasis
from cachegen.fitting.attention import attention_stats, component_weights
from cachegen.fitting.kvtc import (
    calibration_ids,
    ensure_kvtc_basis,
    kvtc_calibration_spec,
    pre_rope_kv,
)


def tcq_calibration_spec(
    levels: dict[int, float] | None = None, spec: models.ModelSpec | None = None
) -> dict:
    """What a tcq model (of ``spec``) is fitted on; recorded in the model file and its
    reference."""
    return {
        "basis": kvtc_calibration_spec(),
        "levels": {str(k): v for k, v in (levels or tcq_model.LEVELS).items()},
        "radius_margin": TCQ_RADIUS_MARGIN,
        "query_rows": TCQ_QUERY_ROWS,
        "layer_exponent": tcq_layer_exponent(spec),
        "weights": "attention output error per unit of component error",
        "frame_choices": {
            "offset_units": OFFSET_UNITS,
            "family_shapes": list(tcq_model.FAMILY_SHAPES),
            "family_scales": [tcq_model.FAMILY_SCALES, *tcq_model.FAMILY_SCALE_RANGE],
        },
    }


TCQ_RADIUS_MARGIN = 1.5  # alphabet radius over the largest calibration coefficient
TCQ_QUERY_ROWS = 256  # calibration tokens whose queries weigh the components
# An error is weighed relative to the residual stream's energy at its layer to this power:
# 1 treats errors as relative to the layer's input, 0 as relative to the final residual.
TCQ_LAYER_EXPONENT = 1.0
# ... other than 1 for these models, each chosen among 0, 0.5 and 1 by the KL of levels 23-25
# on the calibration windows of `cachegen calibrate` (docs/codec.md, "Gemma 3's tcq calibration")
TCQ_LAYER_EXPONENTS = {"gemma3-270m": 0.5}


def tcq_layer_exponent(spec: models.ModelSpec | None) -> float:
    return TCQ_LAYER_EXPONENTS.get(spec.name, TCQ_LAYER_EXPONENT) if spec else TCQ_LAYER_EXPONENT


TCQ_STEP_SEARCH = 14  # bisection steps that find a level's step for its bits per element
TCQ_STEP_SEARCH_STRIDE = 4  # ... on every 4th calibration token


def _level_tables(
    coefficients: list[list[np.ndarray]], weights: np.ndarray, steps: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Radii and steps [L, 2, C] and the frequency tables of the kept components (in (layer,
    K/V, component) order) of one level from the calibration coefficients [L][2] ([tokens,
    C]). A component whose calibration range needs a radius above ``MAX_RADIUS`` gets a
    coarser step instead of clipping."""
    L, _, C = weights.shape
    radius = np.zeros((L, 2, C), dtype=np.uint8)
    step = np.zeros((L, 2, C), dtype=np.float32)
    tables = []
    width = 2 * MAX_RADIUS + 1
    for layer in range(L):
        for k in range(2):
            top = TCQ_RADIUS_MARGIN * np.abs(coefficients[layer][k]).max(axis=0)
            step[layer, k] = np.maximum(steps[k] / np.sqrt(weights[layer, k]), top / MAX_RADIUS)
            y = coefficients[layer][k] / step[layer, k]
            r = np.clip(np.round(TCQ_RADIUS_MARGIN * np.abs(y).max(axis=0)), 0, MAX_RADIUS)
            radius[layer, k] = r
            kept = np.flatnonzero(r)
            if not len(kept):
                continue
            rk = r[kept].astype(np.int64)
            sym = np.clip(np.round(y[:, kept]), -rk, rk).astype(np.int64) + rk
            flat = (np.arange(len(kept)) * width)[None, :] + sym
            counts = np.bincount(flat.reshape(-1), minlength=len(kept) * width)
            freq = rans.quantize_frequencies(counts.reshape(len(kept), width), 2 * rk + 1)
            tables.extend(freq[j, : 2 * rk[j] + 1] for j in range(len(kept)))
    return radius, step, tables


def _calibration_bits(coefficients: list[list[np.ndarray]], steps: np.ndarray) -> float:
    """Bits per element the calibration coefficients cost with ``steps`` [L, 2, C] under
    tables fitted to them (their empirical entropy; dropped components cost nothing)."""
    total = elements = 0.0
    for layer, pair in enumerate(coefficients):
        for k, y in enumerate(pair):
            sym = np.round(y / steps[layer, k]).astype(np.int64)
            sym -= sym.min(axis=0)
            width = int(sym.max()) + 1
            counts = np.bincount(
                (sym + np.arange(sym.shape[1]) * width).reshape(-1), minlength=sym.shape[1] * width
            ).reshape(sym.shape[1], width)
            p = counts[counts > 0] / len(y)
            total -= float(np.sum(counts[counts > 0] * np.log2(p)))
            elements += y.size
    return total / elements


def _step_for_bits(coefficients, weights: np.ndarray, bits: float) -> float:
    """The step (for keys and values alike: the weights put both in one unit) at which the
    calibration coefficients cost ``bits`` per element, by bisection on its logarithm."""
    low, high = -12.0, 12.0
    root = np.sqrt(weights.astype(np.float64))
    sample = [[y[::TCQ_STEP_SEARCH_STRIDE] for y in pair] for pair in coefficients]
    for _ in range(TCQ_STEP_SEARCH):
        mid = (low + high) / 2
        if _calibration_bits(sample, 2.0**mid / root) > bits:
            low = mid
        else:
            high = mid
    return float(2.0**high)


def fit_tcq_model(
    spec: models.ModelSpec,
    levels: dict[int, float] | None = None,
    *,
    basis: TransformBasis | None = None,
    unit_weights: bool = False,
) -> tcq_model.TcqModel:
    """Fit the tcq model of ``spec`` on the ``calibrate`` split: the KVTC basis, the component
    weights, and for each level (``levels``: id -> bits per element on the calibration text;
    default ``tcq_model.LEVELS``) the step that costs those bits, its radii and rANS tables from
    the histograms of the calibration coefficients.

    For ablations (``cachegen.lab.experiments.tcq_ablation``): ``basis`` replaces the KVTC basis
    (the weights are computed for it), ``unit_weights`` gives every component the weight 1
    (one step for all); the model's calibration records either."""
    from cachegen.extract import load_model

    levels = dict(sorted((levels or tcq_model.LEVELS).items()))  # the file keeps levels in order
    calibration = tcq_calibration_spec(levels, spec)
    if basis is None:
        basis = ensure_kvtc_basis(spec)
    else:
        calibration["basis"] = basis.calibration
    hf_model, tokenizer, spec = load_model(spec)
    ids = calibration_ids(tokenizer, spec)
    skip = kvtc_basis.EXACT_TOKENS
    kv, stats = attention_stats(hf_model, spec, ids, skip, TCQ_QUERY_ROWS)
    identity = spec.identity()
    if unit_weights:
        weights = np.ones(basis.variances.shape, dtype=np.float32)
        calibration["weights"] = "none: every component weighs 1"
    else:
        weights = component_weights(hf_model, kv, stats, basis, calibration["layer_exponent"])
    keys, values = pre_rope_kv(kv, basis.rope_thetas, skip)
    L, H, n, D = keys.shape
    coefficients = [
        [
            (x[layer].permute(1, 0, 2).reshape(n, H * D).numpy() - basis.mean[layer, k])
            @ basis.components[layer, k].T
            for k, x in enumerate((keys, values))
        ]
        for layer in range(L)
    ]
    steps_of, radii, steps, tables = {}, [], [], []
    for level, bits in levels.items():
        step = _step_for_bits(coefficients, weights, bits)
        steps_of[level] = (step, step)
        radius, level_steps, level_tables = _level_tables(coefficients, weights, steps_of[level])
        radii.append(radius)
        steps.append(level_steps)
        tables.extend(level_tables)
    freq = np.concatenate(tables).astype(np.uint16) if tables else np.zeros(0, np.uint16)
    return tcq_model.TcqModel(
        identity,
        calibration,
        basis.rope_thetas,
        steps_of,
        basis.mean,
        basis.components,
        weights,
        np.stack(radii),
        np.stack(steps),
        freq,
        tcq_model.family_weights(),
    )


def ensure_tcq_model(model: str | models.ModelSpec) -> tcq_model.TcqModel:
    """The model's tcq model: the one shipped with the package for this model and recipe
    (every machine names the same id; it replaces a local one of the same recipe), else the
    stored one of the recipe, else fitted and stored on first use (or when it was fitted on
    other text or for other levels); a stored or shipped one is read and checked like any."""
    spec = models.resolve(model) if isinstance(model, str) else model
    identity = spec.identity()
    recipe = tcq_calibration_spec(spec=spec)
    shipped = tcq_model.shipped_tcq_model(identity, recipe)
    ref = tcq_model.read_tcq_ref(identity)
    if shipped is not None:
        if ref is None or ref["model_file"] != shipped.id:
            with locked(profile_path(identity).parent):
                tcq_model.write_tcq_ref(shipped)
        return shipped
    if ref is not None and ref["calibration"] == recipe:
        return tcq_model.find_tcq_model(ref["model_file"], identity)
    fitted = fit_tcq_model(spec)
    with locked(profile_path(identity).parent):
        saved = tcq_model.save_tcq_model(fitted)
        tcq_model.write_tcq_ref(saved)
        return saved
