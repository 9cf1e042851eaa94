"""The embedded models' tcq model files ship with the package: a fresh machine takes them
instead of fitting, so every machine names the same id; a stream naming one decodes with an
empty cache; a damaged or foreign file is refused; a refit here agrees with the shipped one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cachegen import workload
from cachegen.codec import CodecError, decode, get_codec, inspect
from cachegen.codec.cachegen.profile import SHIPPED_DIR
from cachegen.codec.tcq import model as tcq_model
from cachegen.extract import extract_kv, load_model, tokenize
from cachegen.fitting.tcq import ensure_tcq_model, fit_tcq_model, tcq_calibration_spec
from cachegen.profiles import codec_for
from tests.codec import refit_guard
from tests.codec.transform_support import forget_fitted_files, relative_error
from tests.support import empty_cache_env
from tests.worker_threads import torch_on_own_cores

LEVEL = 22  # SmolLM2's shipped tcq default
# a refit's held-out reconstruction error (and bits) within this fraction of the shipped one's
REFIT_TOLERANCE = 0.05


def content_id(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:32]


def shipped_path(spec) -> Path:
    found = tcq_model.shipped_tcq_model(spec.identity(), tcq_calibration_spec(spec=spec))
    assert found is not None, f"no shipped tcq model file for {spec.name}"
    return SHIPPED_DIR / f"{found.id}.cgtq"


@pytest.fixture
def fresh(isolated_profiles):
    """An empty profile directory and no model file in memory."""
    forget_fitted_files()
    yield isolated_profiles
    forget_fitted_files()


@pytest.fixture(scope="module")
def held_out_kv(smollm2):
    """The KV of a held-out domain's first 256 tokens (the model runs over those only)."""
    ids = tokenize(load_model(smollm2)[1], workload.domain_text("prose")[:4000])[:256]
    with torch_on_own_cores():
        return extract_kv(smollm2, token_ids=ids)


def test_each_embedded_model_ships_one_file_named_by_its_content(smollm2, gemma3):
    paths = {spec.name: shipped_path(spec) for spec in (smollm2, gemma3)}
    assert sorted(paths.values()) == sorted(SHIPPED_DIR.glob("*.cgtq"))
    for name, path in paths.items():
        assert path.stem == content_id(path)
        assert tcq_model.parse_tcq_model(path.read_bytes(), str(path)).model.name == name


def test_a_fresh_cache_takes_the_shipped_file_without_fitting(smollm2, fresh):
    path = shipped_path(smollm2)
    forget_fitted_files()
    got = ensure_tcq_model("smollm2-135m")
    assert got.id == content_id(path) and got.file_bytes == path.read_bytes()
    # a fit would have left its kvtc basis and its model file in the transforms directory
    transforms = fresh / "transforms"
    assert not transforms.exists() or list(transforms.iterdir()) == []
    assert tcq_model.read_tcq_ref(smollm2.identity())["model_file"] == got.id
    codec = codec_for("tcq", smollm2)
    assert codec.tcq.id == got.id and codec.calibrated_levels()["default_level"] == LEVEL


def test_each_embedded_models_tcq_default_is_its_2_percent_level(smollm2, gemma3, fresh):
    """The rule docs/codec.md states ("A sixth held-out domain: science"): the default is the
    level the shipped calibration chose for a 2% perplexity target."""
    for spec in (smollm2, gemma3):
        levels = codec_for("tcq", spec).calibrated_levels()
        two_percent = [level for level, target in levels["targets"].items() if target == 2.0]
        assert [levels["default_level"]] == two_percent, spec.name
    assert codec_for("tcq", smollm2).default_level == LEVEL


def test_the_shipped_file_replaces_a_local_one_of_the_same_recipe(smollm2, fresh):
    shipped = ensure_tcq_model(smollm2)
    local = dataclasses.replace(shipped, steps=shipped.steps * 1.001)
    assert local.calibration == shipped.calibration and local.id != shipped.id
    tcq_model.save_tcq_model(local)
    tcq_model.write_tcq_ref(local)
    assert ensure_tcq_model(smollm2).id == shipped.id
    assert tcq_model.read_tcq_ref(smollm2.identity())["model_file"] == shipped.id
    forget_fitted_files()
    assert tcq_model.find_tcq_model(local.id, smollm2.identity()) == local  # its streams decode


PROBE = """
import hashlib, json, sys
from pathlib import Path
from cachegen.codec import decode
kv = decode(Path(sys.argv[1]).read_bytes())
raw = kv.keys.float().numpy().tobytes() + kv.values.float().numpy().tobytes()
fitting = "cachegen.fitting" in sys.modules
print(json.dumps({"digest": hashlib.sha256(raw).hexdigest(), "loaded": fitting}))
"""


def digest(kv) -> str:
    return hashlib.sha256(
        kv.keys.float().numpy().tobytes() + kv.values.float().numpy().tobytes()
    ).hexdigest()


def test_a_stream_of_the_shipped_file_decodes_with_an_empty_cache(
    smollm2, held_out_kv, fresh, tmp_path
):
    codec = codec_for("tcq", smollm2, chunk_tokens=64)
    blob = codec.encode(held_out_kv, level=LEVEL)
    assert inspect(blob)["transform"] == shipped_path(smollm2).stem
    mine = decode(blob)
    assert relative_error(mine, held_out_kv) < 0.25  # the KV, not noise
    (tmp_path / "kv.cgc").write_bytes(blob)
    env = empty_cache_env(tmp_path, "")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "kv.cgc")],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert theirs == {"digest": digest(mine), "loaded": False}
    empty = Path(env["CACHEGEN_CACHE_DIR"])
    assert not (empty / "profiles" / "transforms").exists()  # read in place, nothing fitted


def test_a_corrupt_or_foreign_shipped_file_is_refused(smollm2, gemma3, fresh, tmp_path):
    original = shipped_path(smollm2)
    copies = tmp_path / "shipped"
    copies.mkdir()
    data = bytearray(original.read_bytes())
    data[-1] ^= 1
    (copies / original.name).write_bytes(bytes(data))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tcq_model.TCQ_MODELS, "shipped", copies)
        forget_fitted_files()
        with pytest.raises(CodecError, match="is corrupt"):
            ensure_tcq_model(smollm2)
        with pytest.raises(CodecError, match="is corrupt"):
            tcq_model.find_tcq_model(original.stem, smollm2.identity())
    forget_fitted_files()
    with pytest.raises(CodecError, match="fitted for model smollm2-135m"):
        tcq_model.find_tcq_model(original.stem, gemma3.identity())
    assert not list(fresh.glob("**/tcq.json"))


def test_the_fit_sources_are_those_the_last_refit_check_passed_with():
    assert refit_guard.recorded_digest() == refit_guard.fit_sources_digest(), (
        "a source of the tcq fit changed since the refit below last passed: run "
        "`make check-refit` (it records the sources' digest in tests/codec/refit_checked.json)"
    )


@pytest.mark.refit
def test_a_refit_here_agrees_with_the_shipped_file_on_held_out_kv(smollm2, held_out_kv, fresh):
    """The comparison is the fitter's own (it fits the kvtc basis too, into an empty profile
    directory): a changed fitter or recipe shows here before it ships. The fit runs on this
    test process's share of the cores (here, one thread fits the very file two fit). Not in
    `make test` (it takes minutes): `make check-refit`, which the test above asks for."""
    shipped = ensure_tcq_model(smollm2)
    with torch_on_own_cores():
        refit = tcq_model.save_tcq_model(fit_tcq_model(smollm2))
    assert refit.calibration == shipped.calibration
    measured = []
    for model_file in (shipped, refit):
        blob = get_codec("tcq", tcq=model_file, chunk_tokens=64).encode(held_out_kv, level=LEVEL)
        out = decode(blob, out_dtype=torch.float32)
        measured.append((relative_error(out, held_out_kv), inspect(blob)["bits_per_element"]))
    (error, bits), (refit_error, refit_bits) = measured
    assert abs(refit_error - error) <= REFIT_TOLERANCE * error
    assert abs(refit_bits - bits) <= REFIT_TOLERANCE * bits
    if os.environ.get(refit_guard.RECORD_ENV) == "1":
        refit_guard.record_digest()
