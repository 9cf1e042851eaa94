"""The model's ``tcq`` model (``cachegen.codec.tcq.model``): the KVTC basis, component
weights (:mod:`cachegen.fitting.attention`), and for each level the step that costs its bits
per element on the ``calibrate`` split, with the radii and rANS tables of the calibration
coefficients' histograms."""

from __future__ import annotations

import dataclasses

import numpy as np

from cachegen import models
from cachegen.codec.cachegen.profile import locked, profile_path
from cachegen.codec.coding import rans
from cachegen.codec.errors import CodecError
from cachegen.codec.tcq import model as tcq_model
from cachegen.codec.tcq.code import OFFSET_UNITS
from cachegen.codec.tcq.model import MAX_RADIUS
from cachegen.codec.tcq.predict import largest_shift, layer_predictor, residual_symbols
from cachegen.codec.transform import kvtc_basis
from cachegen.codec.transform.basis import TransformBasis
from cachegen.fitting import sensitivity
from cachegen.fitting.attention import attention_stats, component_weights
from cachegen.fitting.kvtc import (
    calibration_ids,
    ensure_kvtc_basis,
    fit_kv,
    fit_model,
    kvtc_calibration_spec,
    pre_rope_kv,
)


def tcq_calibration_spec(
    levels: dict[int, float] | None = None,
    spec: models.ModelSpec | None = None,
    prediction: bool = False,
) -> dict:
    """What a tcq model (of ``spec``) is fitted on; recorded in the model file and its
    reference. ``prediction``: with the cross-layer predictor (not the default recipe: it
    costs the decoder more than it saves on fast links, docs/codec.md)."""
    recipe = {
        "basis": kvtc_calibration_spec(),
        "levels": {str(k): v for k, v in (levels or tcq_model.LEVELS).items()},
        "radius_margin": TCQ_RADIUS_MARGIN,
        "query_rows": TCQ_QUERY_ROWS,
        "layer_exponent": tcq_layer_exponent(spec),
        "weights": "attention output error per unit of component error",
        "sensitivity": sensitivity.sensitivity_spec(),
        "frame_choices": {
            "offset_units": OFFSET_UNITS,
            "family_shapes": list(tcq_model.FAMILY_SHAPES),
            "family_scales": [tcq_model.FAMILY_SCALES, *tcq_model.FAMILY_SCALE_RANGE],
        },
    }
    if prediction:
        recipe["prediction"] = prediction_spec()
    return recipe


def prediction_spec() -> dict:
    """How the cross-layer predictor is fitted; part of a predicted model file's recipe."""
    return {
        "targets_fraction": TCQ_PREDICTED_FRACTION,
        "ridge": TCQ_PREDICTOR_RIDGE,
        "max_shift": TCQ_PREDICTOR_MAX_SHIFT,
        "min_saving": TCQ_PREDICTION_MIN_SAVING,
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


# The cross-layer predictor (cachegen.codec.tcq.predict): each layer's first quarter of key and
# value components from all of the layer before's, by ridge regression (penalty relative to the
# sources' mean energy) on the first three quarters of the calibration coefficients; the
# largest fixed-point shift that keeps every level's sums exact in float32, at most this.
TCQ_PREDICTED_FRACTION = 0.25
TCQ_PREDICTOR_RIDGE = 1e-2
TCQ_PREDICTOR_MAX_SHIFT = 20
# ... and a layer is predicted at a level only where that saves at least this fraction of its
# targets' bits on the last quarter of the calibration coefficients (not fitted on).
TCQ_PREDICTION_MIN_SAVING = 0.005

TCQ_STEP_SEARCH = 14  # bisection steps that find a level's step for its bits per element
TCQ_STEP_SEARCH_STRIDE = 4  # ... on every 4th calibration token


def _level_quantizer(
    coefficients: list[list[np.ndarray]], weights: np.ndarray, steps: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray]:
    """Radii (uint8) and steps (float32) [L, 2, C] of one level from the calibration
    coefficients [L][2] ([tokens, C]). A component whose calibration range needs a radius above
    ``MAX_RADIUS`` gets a coarser step instead of clipping."""
    L, _, C = weights.shape
    radius = np.zeros((L, 2, C), dtype=np.uint8)
    step = np.zeros((L, 2, C), dtype=np.float32)
    for layer in range(L):
        for k in range(2):
            top = TCQ_RADIUS_MARGIN * np.abs(coefficients[layer][k]).max(axis=0)
            step[layer, k] = np.maximum(steps[k] / np.sqrt(weights[layer, k]), top / MAX_RADIUS)
            y = coefficients[layer][k] / step[layer, k]
            radius[layer, k] = np.clip(
                np.round(TCQ_RADIUS_MARGIN * np.abs(y).max(axis=0)), 0, MAX_RADIUS
            )
    return radius, step


def _level_tables(
    coefficients: list[list[np.ndarray]],
    radius: np.ndarray,
    step: np.ndarray,
    predictors: dict,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One level's frequency tables: the histograms of its kept components' calibration
    symbols, in (layer, K/V, component) order, and those of its predicted layers' targets'
    coded residuals (``predictors``: layer -> its integer predictor), in the same order."""
    L = radius.shape[0]
    kept = [[np.flatnonzero(radius[layer, k]) for k in (0, 1)] for layer in range(L)]
    symbols = [
        [_symbols(coefficients[layer][k][:, kept[layer][k]], step[layer, k], radius[layer, k],
                  kept[layer][k]) for k in (0, 1)]
        for layer in range(L)
    ]  # fmt: skip
    tables, residual_tables = [], []
    for layer in range(L):
        for k in (0, 1):
            r = radius[layer, k][kept[layer][k]].astype(np.int64)
            tables.extend(_histogram_tables(symbols[layer][k] + r, r))
        if layer not in predictors:
            continue
        pair = slice(layer - 1, layer + 1)
        coded = _residuals(predictors[layer], symbols[layer - 1], symbols[layer], radius[pair],
                           kept[pair])  # fmt: skip
        for k in (0, 1):
            n = predictors[layer].targets[k]
            r = radius[layer, k][kept[layer][k][:n]].astype(np.int64)
            residual_tables.extend(_histogram_tables(coded[k][:, :n] + r, r))
    return tables, residual_tables


def _histogram_tables(symbols: np.ndarray, radius: np.ndarray) -> list[np.ndarray]:
    """One frequency table per column of ``symbols`` [tokens, columns] (``0 .. 2r``)."""
    if not symbols.shape[1]:
        return []
    width = 2 * MAX_RADIUS + 1
    flat = (np.arange(symbols.shape[1]) * width)[None, :] + symbols
    counts = np.bincount(flat.reshape(-1), minlength=symbols.shape[1] * width)
    freq = rans.quantize_frequencies(counts.reshape(-1, width), 2 * radius + 1)
    return [freq[j, : 2 * radius[j] + 1] for j in range(len(radius))]


def _residuals(predictor, below: list, symbols: list, radius: np.ndarray, kept: list) -> list:
    """``symbols`` (centred, [tokens, kept] per K/V) with the predicted targets replaced by
    their wrapped residuals, predicted from the layer before's ``below`` (centred, with its
    radii in ``radius[0]``) without offsets, as the encoder codes them."""
    radii = [radius[at][k][kept[at][k]].astype(np.int64) for at in (0, 1) for k in (0, 1)]
    streams = [*below, *symbols]
    coded = residual_symbols(
        [(1, predictor)],
        radii,
        [(q + r).T.astype(np.uint8) for q, r in zip(streams, radii)],
        [np.zeros(len(r), np.int8) for r in radii],
    )
    return [coded[2 + k].T.astype(np.int64) - radii[2 + k] for k in (0, 1)]


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
    sensitivity: bool = True,
    prediction: bool = False,
) -> tcq_model.TcqModel:
    """Fit the tcq model of ``spec`` on the ``calibrate`` split: the KVTC basis, the component
    weights, and for each level (``levels``: id -> bits per element on the calibration text;
    default ``tcq_model.LEVELS``) the step that costs those bits, its radii and rANS tables from
    the histograms of the calibration coefficients.

    For ablations (``cachegen_lab.experiments.tcq_ablation``): ``basis`` replaces the KVTC basis
    (the weights are computed for it), ``unit_weights`` gives every component the weight 1
    (one step for all), ``sensitivity=False`` leaves out the measured stream sensitivities
    (:mod:`cachegen.fitting.sensitivity`); the model's calibration records each.
    ``prediction`` adds the cross-layer predictor (:func:`fit_predictor`) and its residual
    tables."""
    levels = dict(sorted((levels or tcq_model.LEVELS).items()))  # the file keeps levels in order
    calibration = tcq_calibration_spec(levels, spec, prediction)
    hf_model, tokenizer, spec = fit_model(spec)
    ids = calibration_ids(tokenizer, spec)
    skip = kvtc_basis.EXACT_TOKENS
    kv, stats = attention_stats(hf_model, spec, ids, skip, TCQ_QUERY_ROWS)
    if basis is None:  # a basis fitted here is fitted on this run's KV: the model runs once
        basis = ensure_kvtc_basis(spec, kv)
    else:
        calibration["basis"] = basis.calibration
    identity = spec.identity()
    if unit_weights:
        weights = np.ones(basis.variances.shape, dtype=np.float32)
        calibration["weights"] = "none: every component weighs 1"
    else:
        weights = component_weights(hf_model, kv, stats, basis, calibration["layer_exponent"])
    coefficients = _coefficients(kv, basis, skip)
    if unit_weights or not sensitivity:
        calibration.pop("sensitivity")
    else:
        weights = _sensitive_weights(hf_model, tokenizer, spec, basis, weights, coefficients)
    steps_of, radii, steps = {}, [], []
    for level, bits in levels.items():
        step = _step_for_bits(coefficients, weights, bits)
        steps_of[level] = (step, step)
        level_radius, level_steps = _level_quantizer(coefficients, weights, steps_of[level])
        radii.append(level_radius)
        steps.append(level_steps)
    radius, step = np.stack(radii), np.stack(steps)
    freq, extra = _tables_and_predictor(coefficients, radius, step, prediction)
    return tcq_model.TcqModel(
        identity,
        calibration,
        basis.rope_thetas,
        steps_of,
        basis.mean,
        basis.components,
        weights,
        radius,
        step,
        freq,
        tcq_model.family_weights(),
        **extra,
    )


def with_predictor(model: tcq_model.TcqModel, spec: models.ModelSpec) -> tcq_model.TcqModel:
    """``model`` (a shipped file, say) plus the cross-layer predictor and its residual tables,
    fitted on its own coefficients of the calibration tokens. Its quantizer and tables stay,
    so every level decodes to exactly the KV ``model``'s does; only the coding changes."""
    if model.predicted:
        return model
    calibration = {**model.calibration, "prediction": prediction_spec()}
    _, tokenizer, spec = fit_model(spec)
    skip = kvtc_basis.EXACT_TOKENS
    coefficients = _coefficients(fit_kv(spec, calibration_ids(tokenizer, spec)), model, skip)
    _, extra = _tables_and_predictor(coefficients, model.radius, model.steps, prediction=True)
    return dataclasses.replace(model, calibration=calibration, **extra)


def _coefficients(kv, basis: TransformBasis | tcq_model.TcqModel, skip: int) -> list:
    """The basis's (or a tcq model's) coefficients [L][K/V] ([tokens, C]) of ``kv`` from
    token ``skip`` on."""
    keys, values = pre_rope_kv(kv, basis.rope_thetas, skip)
    L, H, n, D = keys.shape
    return [
        [
            (x[layer].permute(1, 0, 2).reshape(n, H * D).numpy() - basis.mean[layer, k])
            @ basis.components[layer, k].T
            for k, x in enumerate((keys, values))
        ]
        for layer in range(L)
    ]


def _sensitive_weights(hf_model, tokenizer, spec, basis, weights, coefficients) -> np.ndarray:
    """``weights`` times each stream's measured sensitivity, at the step that costs
    ``SENSITIVITY_BITS`` on the calibration coefficients."""
    step = _step_for_bits(coefficients, weights, sensitivity.SENSITIVITY_BITS)
    _, steps = _level_quantizer(coefficients, weights, (step, step))
    windows = sensitivity.sensitivity_windows(tokenizer, spec)
    scale = sensitivity.stream_sensitivities(hf_model, spec, basis, weights, steps, windows)
    return (weights * scale[:, :, None]).astype(np.float32)


def _tables_and_predictor(coefficients, radius, step, prediction: bool) -> tuple:
    """Every level's tables (``freq``) and, with ``prediction``, the model file's predictor
    fields (the predictor, its shifts and the residual tables) as keywords."""
    predicted = _fitted_prediction(coefficients, radius, step) if prediction else None
    tables, residual_tables = [], []
    for x in range(len(radius)):
        predictors = _layer_predictors(*predicted, radius[x], step[x], x) if predicted else {}
        level, residual = _level_tables(coefficients, radius[x], step[x], predictors)
        tables += level
        residual_tables += residual
    if not predicted:
        return _joined(tables), {}
    return _joined(tables), dict(
        predictor=predicted[0], predictor_shift=predicted[1], residual_freq=_joined(residual_tables)
    )


def _fitted_prediction(coefficients, radius, step) -> tuple[np.ndarray, np.ndarray]:
    """The predictor, fitted on most of the calibration tokens, and its shifts [levels, L],
    judged on the rest."""
    split = len(coefficients[0][0]) * 3 // 4
    predictor = fit_predictor([[y[:split] for y in pair] for pair in coefficients])
    check = [[y[split:] for y in pair] for pair in coefficients]
    return predictor, predictor_shifts(predictor, radius, step, check)


def _joined(tables: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(tables).astype(np.uint16) if tables else np.zeros(0, np.uint16)


def _layer_predictors(predictor, shifts, radius, step, level: int) -> dict:
    """Level ``level``'s integer predictor of each predicted layer (``shifts`` [levels, L]:
    0 not)."""
    kept = [[np.flatnonzero(radius[layer, k]) for k in (0, 1)] for layer in range(len(radius))]
    return {
        layer: layer_predictor(predictor[layer], kept, step, radius, layer, int(shift))
        for layer, shift in enumerate(shifts[level])
        if shift
    }


def fit_predictor(coefficients: list[list[np.ndarray]]) -> np.ndarray:
    """The cross-layer predictor [L, 2, 2C, T] (float16): each layer's first ``T`` key and
    value coefficients from all of the layer before's (keys then values), by ridge regression
    on the calibration coefficients ([L][2] of [tokens, C]); layer 0 has none (zeros)."""
    L, C = len(coefficients), coefficients[0][0].shape[1]
    targets = max(1, int(C * TCQ_PREDICTED_FRACTION))
    out = np.zeros((L, 2, 2 * C, targets), dtype=np.float16)
    for layer in range(1, L):
        x = np.concatenate(coefficients[layer - 1], axis=1).astype(np.float64)
        gram = x.T @ x
        gram += TCQ_PREDICTOR_RIDGE * np.trace(gram) / len(gram) * np.eye(len(gram))
        for k in (0, 1):
            cross = x.T @ coefficients[layer][k][:, :targets].astype(np.float64)
            weights = np.linalg.solve(gram, cross)
            out[layer, k] = np.clip(weights, -65504, 65504).astype(np.float16)
    return out


def predictor_shifts(
    predictor: np.ndarray,
    radius: np.ndarray,
    steps: np.ndarray,
    coefficients: list[list[np.ndarray]],
) -> np.ndarray:
    """[levels, L] (uint8): per level and layer the largest fixed-point shift (at most
    ``TCQ_PREDICTOR_MAX_SHIFT``) whose integer predictor keeps every sum exact in float32, or
    0 (the layer is not predicted) for layer 0 and where the prediction does not save
    ``TCQ_PREDICTION_MIN_SAVING`` of its targets' bits on ``coefficients`` (calibration
    coefficients the predictor was not fitted on)."""
    levels, L = radius.shape[:2]
    shifts = np.zeros((levels, L), dtype=np.uint8)
    sample = coefficients
    for x in range(levels):
        kept = [[np.flatnonzero(radius[x, layer, k]) for k in (0, 1)] for layer in range(L)]
        for layer in range(1, L):
            shift = largest_shift(
                predictor[layer], kept, steps[x], radius[x], layer, TCQ_PREDICTOR_MAX_SHIFT
            )
            level = (predictor[layer], kept, steps[x], radius[x])
            if shift and _saving(*level, layer, shift, sample) >= TCQ_PREDICTION_MIN_SAVING:
                shifts[x, layer] = shift
    return shifts


def _saving(weights, kept, steps, radius, layer: int, shift: int, coefficients) -> float:
    """The fraction of layer ``layer``'s targets' bits (plug-in entropy of their symbols on
    ``coefficients``, [L][2] of [tokens, C]) its integer prediction saves."""
    predictor = layer_predictor(weights, kept, steps, radius, layer, shift)
    symbols = [
        [_symbols(coefficients[at][k][:, kept[at][k]], steps[at, k], radius[at, k], kept[at][k])
         for k in (0, 1)]
        for at in (layer - 1, layer)
    ]  # fmt: skip
    residuals = _residuals(predictor, symbols[0], symbols[1], radius[layer - 1 : layer + 1],
                           kept[layer - 1 : layer + 1])  # fmt: skip
    before = after = 0.0
    for k in (0, 1):
        n = predictor.targets[k]
        before += _column_bits(symbols[1][k][:, :n])
        after += _column_bits(residuals[k][:, :n])
    return 1 - after / before if before else 0.0


def _symbols(y: np.ndarray, steps: np.ndarray, radius: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Centred symbols of coefficients ``y`` [tokens, kept] at the kept components' steps."""
    r = radius[kept].astype(np.float64)
    return np.clip(np.round(y / steps[kept]), -r, r).astype(np.int64)


def _column_bits(symbols: np.ndarray) -> float:
    """Plug-in entropy in bits of each column of ``symbols`` [tokens, columns], summed."""
    values = symbols.astype(np.int64)
    values -= values.min(initial=0)
    width = int(values.max(initial=0)) + 1
    cells = values + np.arange(values.shape[1])[None, :] * width
    counts = np.bincount(cells.reshape(-1), minlength=values.shape[1] * width)
    counts = counts[counts > 0].astype(np.float64)
    return float(np.sum(counts * np.log2(len(values) / counts)))


def ensure_tcq_model(model: str | models.ModelSpec, fit: bool = True) -> tcq_model.TcqModel:
    """The model's tcq model: the one shipped with the package for this model and recipe
    (every machine names the same id; it replaces a local one of the same recipe), else the
    stored one of the recipe, else fitted and stored on first use (or when it was fitted on
    other text or for other levels); a stored or shipped one is read and checked like any.
    ``fit=False`` (a server) never fits: without a shipped or stored model file it raises
    ``CodecError`` naming the command that makes one."""
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
    if not fit:
        raise CodecError(
            f"no tcq model file for {spec.name} of this release's recipe (none ships for it, "
            f"none is in {tcq_model.tcq_ref_path(identity).parent}); run "
            f"`cachegen profile build --model {spec.name} --codec tcq` first"
        )
    fitted = fit_tcq_model(spec)
    with locked(profile_path(identity).parent):
        saved = tcq_model.save_tcq_model(fitted)
        tcq_model.write_tcq_ref(saved)
        return saved
