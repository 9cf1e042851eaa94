"""tcq's cross-layer prediction: integer arithmetic that changes which symbols are coded, never
the quantized values, so a predicted stream decodes to the KV of the same model file without a
predictor, bit for bit; its sums are exact in float32; a predictor that could leave float32's
exact range is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cachegen.codec import CodecError, decode, get_codec, inspect
from cachegen.codec.coding.bitstream import parse_header
from cachegen.codec.tcq import code as tcq_code
from cachegen.codec.tcq import model as tcq_model
from cachegen.codec.tcq.predict import (
    EXACT_LIMIT,
    OFFSET_BOUND,
    apply_predictions,
    layer_predictor,
)
from cachegen.fitting.tcq import (
    TCQ_PREDICTOR_MAX_SHIFT,
    ensure_tcq_model,
    fit_tcq_model,
    with_predictor,
)

LEVELS = sorted(tcq_model.LEVELS)


@pytest.fixture(scope="module")
def model_file(tiny_llama, profiles) -> tcq_model.TcqModel:
    """The default recipe's model file plus the predictor (saved, so its streams decode)."""
    return tcq_model.save_tcq_model(fit_tcq_model(tiny_llama, prediction=True))


@pytest.fixture(scope="module")
def unpredicted(model_file) -> tcq_model.TcqModel:
    """The same model file without its predictor (saved, so that its streams decode)."""
    plain = dataclasses.replace(
        model_file,
        predictor=np.zeros((0, 2, 0, 0), np.float16),
        predictor_shift=np.zeros((0, 0), np.uint8),
    )
    return tcq_model.save_tcq_model(plain)


def _same(a, b) -> bool:
    return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_default_recipe_has_no_predictor_and_the_fit_adds_one(tiny_llama, model_file):
    assert not ensure_tcq_model(tiny_llama).predicted  # prediction is opt-in
    assert model_file.calibration["prediction"]["targets_fraction"] == 0.25
    L = model_file.model.num_layers
    C = model_file.model.num_kv_heads * model_file.model.head_dim
    assert model_file.predicted and model_file.predictor.shape == (L, 2, 2 * C, C // 4)
    assert model_file.predictor_shift.shape == (len(LEVELS), L)
    assert np.all(model_file.predictor_shift[:, 0] == 0)  # layer 0 has no layer before it
    assert np.any(model_file.predictor_shift[:, 1:] > 0)


def test_a_predictor_added_to_a_fitted_file_is_the_one_a_fit_with_prediction_makes(
    tiny_llama, model_file
):
    """``with_predictor`` on the default recipe's file (as on a shipped one) fits the predictor
    on that file's own coefficients: here the very file the fit with prediction writes."""
    base = ensure_tcq_model(tiny_llama)
    added = with_predictor(base, tiny_llama)
    assert added.predicted and not base.predicted
    assert np.array_equal(added.freq, base.freq) and np.array_equal(added.steps, base.steps)
    assert added.id == model_file.id
    assert with_predictor(added, tiny_llama) is added


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_predicted_streams_decode_to_the_unpredicted_kv(kv, model_file, unpredicted, out_dtype):
    predicted_codec = get_codec("tcq", tcq=model_file, chunk_tokens=64)
    plain_codec = get_codec("tcq", tcq=unpredicted, chunk_tokens=64)
    for level in LEVELS:
        predicted = predicted_codec.encode(kv, level)
        plain = plain_codec.encode(kv, level)
        assert parse_header(predicted).params[16] == 7 and parse_header(plain).params[16] == 5
        assert _same(decode(predicted, out_dtype), decode(plain, out_dtype)), level
        assert inspect(predicted)["bits_per_element"] != inspect(plain)["bits_per_element"]


@pytest.mark.parametrize("layers", [[1, 2], [0, 2, 3], [3]])
def test_layer_subsets_predict_only_from_a_layer_they_hold(kv, model_file, layers):
    """A layer is predicted from the layer before when the stream holds that layer too;
    whichever the subset, it decodes to the full stream's values of its layers."""
    codec = get_codec("tcq", tcq=model_file, chunk_tokens=64)
    full = decode(codec.encode(kv, LEVELS[3]))
    part = decode(codec.encode(kv.select_layers(layers), LEVELS[3]))
    assert part.layers == tuple(layers)
    for i, layer in enumerate(layers):
        assert torch.equal(part.keys[i], full.keys[layer])
        assert torch.equal(part.values[i], full.values[layer])
    code = tcq_code.level_code(model_file, LEVELS[3])
    predicted = [i for i, _ in code.predicted_layers(tuple(layers))]
    assert predicted == [
        i
        for i in range(1, len(layers))
        if layers[i - 1] == layers[i] - 1 and layers[i] in code.predictors
    ]


def test_guesses_are_exact_sums_at_the_bound(model_file):
    """The float32 product (torch's BLAS) and the kernels' rounding and wrapping equal int64
    arithmetic (docs/bitstream.md, "Predicted layers") for sources at the largest magnitudes
    the bound allows, and the encoder's direction undoes the decoder's."""
    level = LEVELS[-1]
    x = model_file.level_index(level)
    code = tcq_code.level_code(model_file, level)
    predictor = code.predictors[1]
    radii = [model_file.radius[x, layer, k][code.kept[layer][k]].astype(np.int64)
             for layer in (0, 1) for k in (0, 1)]  # fmt: skip
    rng = np.random.default_rng(0)
    tokens, width = 64, max(len(r) for r in radii)
    values = np.zeros((4, tokens, width), np.float32)
    offsets = [rng.integers(-OFFSET_BOUND, OFFSET_BOUND + 1, len(r)).astype(np.int8) for r in radii]
    for s in (0, 1):  # sources at +-r, offsets +-127: the bound's extremes
        offsets[s] = (OFFSET_BOUND * rng.choice([-1, 1], len(radii[s]))).astype(np.int8)
        values[s, :, : len(radii[s])] = radii[s] * rng.choice([-1, 1], (tokens, len(radii[s])))
    for s in (2, 3):
        values[s, :, : len(radii[s])] = rng.integers(
            -radii[s], radii[s] + 1, (tokens, len(radii[s]))
        )
    first = np.cumsum([0] + [len(r) for r in radii])
    flat_r, flat_o = np.concatenate(radii), np.concatenate(offsets)
    restored = values.copy()
    apply_predictions([(1, predictor)], restored, flat_r, first, flat_o, 1)

    sources = np.concatenate([4 * values[s, :, : len(radii[s])].astype(np.int64)
                              + offsets[s] for s in (0, 1)], axis=1)  # fmt: skip
    target_offsets = np.concatenate([offsets[2 + k][: predictor.targets[k]] for k in (0, 1)])
    target_offsets = target_offsets.astype(np.int64)
    total = sources @ predictor.matrix.astype(np.int64) - target_offsets * 2**predictor.shift
    assert np.abs(total).max() < EXACT_LIMIT
    guess = np.round(total / 2.0 ** (predictor.shift + 2)).astype(np.int64)
    column = 0
    for k in (0, 1):
        n, r = predictor.targets[k], radii[2 + k][: predictor.targets[k]]
        want = np.mod(values[2 + k, :, :n] + guess[:, column : column + n] + r, 2 * r + 1) - r
        np.testing.assert_array_equal(restored[2 + k, :, :n], want)
        np.testing.assert_array_equal(restored[2 + k, :, n:], values[2 + k, :, n:])
        column += n
    apply_predictions([(1, predictor)], restored, flat_r, first, flat_o, -1)
    np.testing.assert_array_equal(restored, values)


def test_the_shift_is_the_largest_that_stays_exact(model_file):
    x = model_file.level_index(LEVELS[0])
    kept = [[np.flatnonzero(model_file.radius[x, i, k]) for k in (0, 1)] for i in range(4)]
    args = (model_file.steps[x], model_file.radius[x])
    for layer in range(1, model_file.model.num_layers):
        shift = int(model_file.predictor_shift[x, layer])
        if not shift:  # not predicted: its prediction saved too little on calibration text
            continue
        layer_predictor(model_file.predictor[layer], kept, *args, layer, shift)
        if shift < TCQ_PREDICTOR_MAX_SHIFT:
            with pytest.raises(CodecError, match="exact range"):
                layer_predictor(model_file.predictor[layer], kept, *args, layer, shift + 1)


def test_a_predictor_that_could_leave_the_exact_range_is_refused(kv, model_file):
    shifts = model_file.predictor_shift.copy()
    raised = np.minimum(shifts.astype(int) + 6, tcq_model.MAX_PREDICTOR_SHIFT)
    shifts = np.where(shifts > 0, raised, 0).astype(np.uint8)  # the same layers predicted
    broken = dataclasses.replace(model_file, predictor_shift=shifts)
    again = tcq_model.parse_tcq_model(broken.file_bytes, "test", broken.id)  # it parses
    with pytest.raises(CodecError, match="exact range"):
        get_codec("tcq", tcq=again).encode(kv, LEVELS[0])
