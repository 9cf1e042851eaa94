"""The tcq fit's measured stream sensitivities (``cachegen.fitting.sensitivity``): each stream
is quantized alone and exactly where it should be (its refined rows a quarter step finer), the
windows are calibration text the basis did not see, and a stream the model cannot read
measures as the least sensitive."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from cachegen import workload
from cachegen.codec.tcq.refine import refined_rows
from cachegen.codec.transform import kvtc_basis
from cachegen.codec.transform.rotary import rotate_layer_keys
from cachegen.extract import load_model
from cachegen.fitting import sensitivity
from cachegen.fitting.kvtc import KVTC_CALIBRATION_TOKENS, ensure_kvtc_basis
from cachegen.fitting.tcq import ensure_tcq_model


@pytest.fixture(scope="module")
def fitted(tiny_llama, profiles):
    hf_model, tokenizer, spec = load_model(tiny_llama)
    return hf_model, tokenizer, spec, ensure_kvtc_basis(spec), ensure_tcq_model(spec)


def _coefficients(x: torch.Tensor, basis, layer: int, k: int, thetas) -> np.ndarray:
    """The basis's coefficients of one stream's non-exact tokens (x: [H, T, D] post-RoPE)."""
    skip = kvtc_basis.EXACT_TOKENS
    x = x[None, :, skip:].float()
    if k == 0:
        x = rotate_layer_keys(x, skip, thetas, inverse=True)
    H, n, D = x.shape[1:]
    rows = x[0].permute(1, 0, 2).reshape(n, H * D).double().numpy()
    return (rows - basis.mean[layer, k]) @ basis.components[layer, k].T.astype(np.float64)


@pytest.mark.parametrize("k", [0, 1])
def test_one_stream_is_quantized_alone_and_its_error_is_weighed(kv, fitted, k):
    _, _, _, basis, model = fitted
    kv = copy.deepcopy(kv.to(torch.float32))
    layer, level = 1, 22
    kv.values[layer, :, [3, 7]] *= 0.1  # two attention sinks: their rows are refined
    steps = model.steps[list(model.levels).index(level)]
    perturbed, made = sensitivity._quantized_stream(kv, basis, model.weights, steps, layer, k)
    for other in range(kv.num_layers):
        for j, (a, b) in enumerate(((kv.keys, perturbed.keys), (kv.values, perturbed.values))):
            if (other, j) != (layer, k):
                assert torch.equal(a[other], b[other])
    stream = ((kv.keys, perturbed.keys), (kv.values, perturbed.values))[k]
    skip = kvtc_basis.EXACT_TOKENS
    assert torch.equal(stream[0][layer, :, :skip], stream[1][layer, :, :skip])
    thetas = basis.rope_thetas[layer : layer + 1]
    before = _coefficients(stream[0][layer], basis, layer, k, thetas)
    after = _coefficients(stream[1][layer], basis, layer, k, thetas)
    step = steps[layer, k].astype(np.float64)
    atol = 1e-3 * step.max()
    # the rows coded frames refine (by the values' norms) are a quarter step finer
    rows = refined_rows(kv.values[layer : layer + 1, :, skip:])[0]
    assert rows.any() and not rows.all()
    rounded = step * np.round(before / step)
    np.testing.assert_allclose(after[~rows], rounded[~rows], atol=atol)
    quarters = step / 4 * np.round(4 * before[rows] / step)
    np.testing.assert_allclose(after[rows], quarters, atol=atol)
    weighed = float(((after - before) ** 2 @ model.weights[layer, k].astype(np.float64)).mean())
    assert made > 0 and made == pytest.approx(weighed, rel=1e-3)


def test_windows_are_calibration_text_after_the_basis_tokens(fitted):
    _, tokenizer, spec, _, _ = fitted
    windows = sensitivity.sensitivity_windows(tokenizer, spec)
    assert len(windows) == sensitivity.SENSITIVITY_WINDOWS
    ids = tokenizer(workload.text("calibrate"))["input_ids"][KVTC_CALIBRATION_TOKENS:]
    joined = torch.cat(windows).tolist()
    assert joined == ids[: len(joined)]
    evaluation = tokenizer(workload.text("eval"))["input_ids"]
    assert ids[:64] != evaluation[:64] and workload.text("eval") not in workload.text("calibrate")


def test_a_layer_the_model_cannot_read_measures_least_sensitive(fitted, monkeypatch):
    hf_model, tokenizer, spec, basis, model = fitted
    monkeypatch.setattr(sensitivity, "SENSITIVITY_WINDOWS", 1)
    deaf = copy.deepcopy(hf_model)
    with torch.no_grad():  # layer 0's attention output is 0 whatever its keys and values
        deaf.model.layers[0].self_attn.o_proj.weight.zero_()
    windows = [w[:256] for w in sensitivity.sensitivity_windows(tokenizer, spec)]
    steps = model.steps[list(model.levels).index(22)]
    got = sensitivity.stream_sensitivities(deaf, spec, basis, model.weights, steps, windows)
    assert got.shape == (spec.identity().num_layers, 2)
    low = 1 / sensitivity.SENSITIVITY_RANGE
    np.testing.assert_array_equal(got[0], [low, low])
    assert (got[1:] > low).all() and (got <= sensitivity.SENSITIVITY_RANGE).all()


@pytest.mark.parametrize("name", ["tiny_llama", "gemma3"])
def test_a_perturbed_pass_replays_the_layers_below_to_the_last_bit(name, request):
    """Skipping the layers below the perturbed one changes no logit: a full pass over the same
    perturbed KV gives the same log-probabilities (Gemma 3 for its sliding-window layers)."""
    from cachegen.extract import extract_kv

    hf_model, tokenizer, spec = load_model(request.getfixturevalue(name))
    ids = torch.tensor(tokenizer(workload.text("calibrate"))["input_ids"][:288])
    context, continuation = ids[:-32], ids[-32:]
    kv = extract_kv(spec, token_ids=context)
    passes = sensitivity._ContinuationPasses(hf_model, kv, continuation)
    full = sensitivity._ContinuationPasses(hf_model, kv, continuation)  # the same exact pass
    assert torch.equal(passes.reference, full.reference)
    generator = torch.Generator().manual_seed(0)
    for layer in (1, kv.num_layers - 1):
        perturbed = copy.deepcopy(kv)
        noise = torch.randn(perturbed.values[layer].shape, generator=generator)
        perturbed.values[layer] += (0.5 * noise).to(perturbed.values.dtype)
        got = passes.perturbed(perturbed, layer)
        assert torch.equal(got, full.perturbed(perturbed, 0))  # 0: every layer runs
        assert not torch.equal(got, passes.reference)
    assert all("forward" not in vars(module) for module in passes.layers)
