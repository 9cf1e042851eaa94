"""The tcq ablation: its variants fit (in memory only), round-trip, and differ from the shipped
model in exactly the part they ablate; the default fit is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachegen.codec.tcq import codec as tcq
from cachegen.codec.tcq import model as tcq_model
from cachegen.codec.transform import model_file
from cachegen.fitting.kvtc import ensure_kvtc_basis
from cachegen.fitting.tcq import ensure_tcq_model, fit_tcq_model
from cachegen_lab.experiments import tcq_ablation

TEXT = "The quick brown fox jumps over the lazy dog. " * 20
LEVELS = [21, 24]


@pytest.fixture(scope="module")
def shipped(tiny_llama, profiles) -> tcq_model.TcqModel:
    return ensure_tcq_model(tiny_llama)


@pytest.fixture(scope="module")
def variants(tiny_llama, shipped) -> dict[str, tcq_model.TcqModel]:
    stored = sorted(p.name for p in model_file.transforms_dir().iterdir())
    ref = tcq_model.read_tcq_ref(tiny_llama.identity())
    fitted = tcq_ablation.fit_variants(tiny_llama.name, LEVELS)
    # the variants live in memory: nothing new is stored, the model's reference is the same
    assert sorted(p.name for p in model_file.transforms_dir().iterdir()) == stored
    assert tcq_model.read_tcq_ref(tiny_llama.identity()) == ref
    return fitted


def test_both_is_the_shipped_model_and_the_others_differ(variants, shipped):
    assert variants["both"].id == shipped.id
    assert len({m.id for m in variants.values()}) == 4
    for name in ("transform", "weights", "neither"):
        assert list(variants[name].levels) == LEVELS
        assert variants[name].calibration["levels"] == {str(k): tcq_model.LEVELS[k] for k in LEVELS}


def test_transform_has_one_step_per_level_and_the_pca_basis(variants, shipped):
    model = variants["transform"]
    assert np.array_equal(model.components, shipped.components)
    assert np.all(model.weights == 1)
    for index, (key_step, value_step) in enumerate(model.levels.values()):
        assert key_step == value_step
        # every component the level's step, except where the alphabet forces a coarser one
        free = model.radius[index] < tcq_model.MAX_RADIUS
        assert np.allclose(model.steps[index][free], key_step)
        assert free.mean() > 0.5


def test_weights_has_the_identity_basis_and_channel_weights(variants, shipped):
    for name in ("weights", "neither"):
        model = variants[name]
        eye = np.eye(model.components.shape[-1], dtype=np.float32)
        assert np.array_equal(model.components, np.broadcast_to(eye, model.components.shape))
        assert np.array_equal(model.mean, shipped.mean)  # the channel mean, as the basis has it
        assert model.calibration["basis"]["components"] == "identity"
    weighted = variants["weights"].weights
    assert not np.allclose(weighted, weighted.flat[0])  # computed per channel, not all alike
    assert np.all(variants["neither"].weights == 1)


def test_identity_basis_keeps_the_total_variance(tiny_llama, profiles):
    pca = ensure_kvtc_basis(tiny_llama)
    channels = tcq_ablation.identity_basis(pca)
    assert np.allclose(channels.variances.sum(-1), pca.variances.sum(-1), rtol=1e-4)


def test_every_variant_round_trips_and_counts_its_bytes(tiny_llama, variants):
    from cachegen.codec import inspect
    from cachegen.extract import extract_kv

    kv = extract_kv(tiny_llama, text=TEXT)
    original = torch.cat([kv.keys, kv.values]).float()
    for name, model in variants.items():
        errors = []
        for level in LEVELS:
            tally = tcq_ablation.LayerBytes(np.zeros((kv.num_layers, 2)))
            decoded, bits = tcq_ablation.roundtrip(model, level, tally)(kv)
            assert decoded.keys.shape == kv.keys.shape
            assert torch.equal(decoded.token_ids, kv.token_ids)
            blob = tcq.TcqCodec(tcq=model).encode(kv, level=level)
            assert bits == 8 * len(blob)
            if name == "both":  # the shipped model is findable: the library's own count agrees
                assert bits == pytest.approx(inspect(blob)["bits_per_element"] * kv.num_elements)
            # per-layer bytes: every frame body byte, none of the stream's header
            assert 0 < tally.bytes.sum() < len(blob)
            assert tally.elements == kv.num_elements / (2 * kv.num_layers)
            out = torch.cat([decoded.keys, decoded.values]).float()
            errors.append(float((out - original).norm() / original.norm()))
        assert errors[1] < errors[0] < 1, (name, errors)  # finer is closer; better than nothing


def test_default_fit_is_the_fit_with_the_kvtc_basis_and_weights(tiny_llama, shipped):
    assert fit_tcq_model(tiny_llama).id == shipped.id
    explicit = fit_tcq_model(tiny_llama, basis=ensure_kvtc_basis(tiny_llama))
    assert explicit.id == shipped.id


def test_the_calibrate_split_can_be_ablated_to_choose_on(tiny_llama, variants):
    doc = tcq_ablation.run_ablation(
        tiny_llama.name,
        ["pydoc"],
        [LEVELS[0]],
        1,
        48,
        8,
        0,
        "test",
        progress=False,
        split="calibrate",
    )
    assert [d["split"] for d in doc["data"]] == ["calibrate"]
    assert {r["variant"] for r in doc["rows"]} == set(tcq_ablation.VARIANTS)
    assert all(r["dataset"] == "pydoc" for r in doc["rows"])
