"""The tcq redundancy lab: its entropy estimates, contexts and previous-layer predictor find
redundancy exactly where it was put, and nowhere else."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachegen.cli import main
from cachegen.codec.cachegen.quant import rotate_layer_keys
from cachegen.codec.tcq import code as tcq_code
from cachegen.codec.tcq import encode as tcq_encode
from cachegen.codec.tcq import model as tcq_model
from cachegen.extract import extract_kv
from cachegen.fitting.tcq import ensure_tcq_model
from cachegen.kv import KVCache
from cachegen_lab.experiments import tcq_redundancy as lab

TEXT = "The quick brown fox jumps over the lazy dog. " * 20
LEVEL = 24


@pytest.fixture(scope="module")
def model(tiny_llama, profiles) -> tcq_model.TcqModel:
    return ensure_tcq_model(tiny_llama)


def test_entropy_of_known_sources():
    rng = np.random.default_rng(0)
    uniform = rng.integers(-2, 2, size=(40_000, 3))  # 4 equally likely symbols per column
    assert lab._entropy_bits(uniform) / uniform.size == pytest.approx(2.0, abs=0.01)
    # a context that names the symbol leaves nothing to code
    assert lab._entropy_bits(uniform, uniform + 2) == 0.0
    # a context independent of the symbols gains (almost) nothing
    noise = rng.integers(0, 3, size=uniform.shape)
    assert lab._entropy_bits(uniform, noise) / uniform.size == pytest.approx(2.0, abs=0.01)
    constant = np.zeros((100, 2), dtype=np.int16)
    assert lab._entropy_bits(constant) == 0.0


def test_contexts_see_only_what_a_decoder_has_decoded():
    sym = np.arange(-3, 3 * 24 - 3).reshape(3, 24)
    previous = lab.previous_token_context(sym)
    assert np.all(previous[0] == 0)  # the first token has no previous token
    assert np.array_equal(previous[1:], np.minimum(np.abs(sym[:-1]), lab.SIZE_CLASSES - 1))
    loud = lab.loudness_context(sym)
    assert np.all(loud[:, :8] == 0)  # the first group has no earlier components
    # a group's class moves only with the components before it
    changed = sym.copy()
    changed[:, 8:] = 100
    assert np.array_equal(lab.loudness_context(changed)[:, :16], loud[:, :16])


def _with_layers_copied(kv: KVCache) -> KVCache:
    """``kv`` with every layer's keys and values replaced by layer 0's."""
    return KVCache(
        keys=kv.keys[:1].expand_as(kv.keys).clone(),
        values=kv.values[:1].expand_as(kv.values).clone(),
        token_ids=kv.token_ids,
        model=kv.model,
    )


def test_the_predictor_finds_layers_that_repeat_and_only_them(tiny_llama, model):
    kvs = [extract_kv(tiny_llama, text=TEXT[i:]) for i in range(0, 40, 10)]
    copied = [_with_layers_copied(kv) for kv in kvs]
    sources = [None]
    # fitted on repeating layers, measured on others: what repeats is predicted away
    predictors = lab.fit_predictors(model, LEVEL, copied[:2], sources)
    found = lab.measure(model, LEVEL, predictors, sources, copied[2:])
    bits = found["bits_per_element"]
    assert bits["previous_layer_all"] < 0.5 * bits["independent"]
    layers = np.array(found["layer_bits_per_element"]["previous_layer_all"])
    first = np.array(found["layer_bits_per_element"]["independent"])[0]
    assert np.allclose(layers[0], first)  # layer 0 has nothing to predict from
    # on the model's own KV (layers that do not repeat) it saves far less
    plain = lab.measure(
        model, LEVEL, lab.fit_predictors(model, LEVEL, kvs[:2], sources), sources, kvs[2:]
    )["bits_per_element"]
    assert plain["previous_layer_all"] > 0.5 * plain["independent"]
    assert found["tokens"] == sum(kv.num_tokens - tcq_code.EXACT_TOKENS for kv in kvs[2:])


def test_coefficients_are_the_encoders(tiny_llama, model):
    kv = extract_kv(tiny_llama, text=TEXT)
    y = lab.coefficients(model, kv)
    L, H, T, D = kv.keys.shape
    assert y.shape == (L, 2, T - tcq_code.EXACT_TOKENS, H * D)
    code = tcq_code.level_code(model, LEVEL)
    q = torch.cat([kv.keys[None], kv.values[None]])[:, :, :, tcq_code.EXACT_TOKENS :].float()
    q[0] = rotate_layer_keys(q[0], tcq_code.EXACT_TOKENS, model.rope_thetas, inverse=True)
    rows = q[1, 2].permute(1, 0, 2).reshape(-1, H * D)
    sym, _, _ = tcq_encode.quantize_rows(model, code, 2, 1, rows)
    expected = sym.astype(np.int64) - code.radius[2][1][:, None]
    ours = lab.quantized(model, LEVEL, y)[2, 1][:, code.kept[2][1]].T
    clipped = np.abs(ours) > code.radius[2][1][:, None]  # the encoder clips, the lab does not
    assert np.array_equal(ours[~clipped], expected[~clipped])
    assert (~clipped).mean() > 0.5


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sources", "0"], "--sources takes positive counts"),
        (["--sources", "x"], "--sources takes positive counts"),
        (["--level", "99"], "--level must be one of"),
        (["--dataset", "nonsense"], "is not a file"),
    ],
)
def test_bad_arguments_exit_2_with_a_reason(tiny_llama, model, capsys, argv, message):
    code = main(
        [
            "experiment",
            "tcq-redundancy",
            "--model",
            tiny_llama.name,
            "--windows",
            "1",
            "--fit-windows",
            "1",
            "--context-tokens",
            "64",
            "--no-progress",
            *argv,
        ]
    )
    assert code == 2
    assert message in capsys.readouterr().err
