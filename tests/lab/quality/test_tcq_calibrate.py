"""``cachegen calibrate --codec tcq``: every tcq level measured on the calibration windows, the
cheapest one per perplexity target, recorded for its tcq model file (the levels' losses for a
quality bound, and the codec's default)."""

from __future__ import annotations

import json

import pytest

from cachegen import models
from cachegen.cli import main
from cachegen.codec import CodecError
from cachegen.codec.cachegen.profile import SHIPPED_DIR
from cachegen.codec.form_loss import form_losses
from cachegen.codec.tcq import levels as tcq_levels
from cachegen.codec.tcq.levels import read_tcq_levels, tcq_levels_path
from cachegen.errors import InputError
from cachegen.fitting.tcq import tcq_calibration_spec
from cachegen.profiles import codec_for
from cachegen_lab.quality.calibrate import CalibrationSettings
from cachegen_lab.quality.tcq_calibrate import (
    LevelTrial,
    calibrate_tcq,
    choose_level,
    choose_tcq_again,
    read_calibration,
    save_choices,
    unmet,
)

SMALL = CalibrationSettings(
    targets=(1000.0,), windows=2, context_tokens=96, continuation_tokens=16, chunk_tokens=64
)


@pytest.fixture(scope="module")
def document(profiles, tiny_llama):
    return calibrate_tcq(tiny_llama.name, SMALL, progress=False)


def test_every_level_is_measured_on_the_calibration_split(document, tiny_llama):
    codec = codec_for("tcq", tiny_llama)
    assert document["split"] == "calibrate" and document["tcq_model"] == codec.profile_id
    assert [t["level"] for t in document["trials"]] == codec.levels
    bits = [t["bits_per_element"] for t in document["trials"]]
    assert bits == sorted(bits) and bits[0] > 0  # a finer level costs more
    assert all(t["kl"] > 0 and 0 <= t["top1_agreement"] <= 1 for t in document["trials"])
    # a target every level meets takes the cheapest
    assert document["choices"] == [
        {**document["choices"][0], "target_ppl_pct": 1000.0, "level": codec.levels[0]}
    ]


def test_a_target_takes_the_cheapest_level_within_it():
    trials = [
        LevelTrial(20, 1.0, kl=0.10, ppl_change_pct=8.0),
        LevelTrial(21, 1.5, kl=0.02, ppl_change_pct=1.8),
        LevelTrial(22, 2.0, kl=0.01, ppl_change_pct=0.9),
    ]
    by_ppl = CalibrationSettings(select="ppl", margin=0.8)
    assert choose_level(trials, 2.5, by_ppl)["level"] == 21  # 1.8 <= 0.8 x 2.5
    assert choose_level(trials, 2.0, by_ppl)["level"] == 22
    chosen = choose_level(trials, 2.5, CalibrationSettings())  # by KL
    assert chosen["level"] in (21, 22) and chosen["kl_budget"] > 0
    with pytest.raises(InputError, match="no tcq level kept"):
        choose_level(trials, 0.5, by_ppl)


def test_recorded_choices_are_losses_and_the_default(document, tiny_llama, tmp_path):
    identity = tiny_llama.identity()
    codec = codec_for("tcq", tiny_llama)
    saved = save_choices(tiny_llama.name, document, make_default=True)
    cheapest = codec.levels[0]
    assert saved == {"targets": {cheapest: 1000.0}, "default_level": cheapest}
    assert read_tcq_levels(identity, codec.profile_id) == saved
    assert read_tcq_levels(identity, "another-model-file") is None  # a refit: unknown
    assert codec_for("tcq", tiny_llama).default_level == cheapest
    names = [f"tcq-{cheapest}", "tcq-26", "raw"]
    losses = form_losses(names, identity.fingerprint, None, saved["targets"])
    assert losses == {f"tcq-{cheapest}": 1000.0, "tcq-26": None, "raw": 0.0}

    path = tmp_path / "tcq-calibration.json"
    path.write_text(json.dumps(document))
    assert read_calibration(path)["choices"] == document["choices"]
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({**document, "tcq_model": "0" * 32}))
    with pytest.raises(InputError, match="calibrate again"):
        save_choices(tiny_llama.name, read_calibration(stale), make_default=False)


def test_an_unmet_target_is_a_result_and_the_others_are_kept(document, tiny_llama, tmp_path):
    codec = codec_for("tcq", tiny_llama)
    trials = [LevelTrial(**t) for t in document["trials"]]
    met = choose_level(trials, 1000.0, SMALL)
    missed = {"target_ppl_pct": 1e-9, "level": None, "unmet": "no tcq level kept ..."}
    first_met = {**document, "choices": [met, missed]}
    assert unmet(first_met) == [missed]
    saved = save_choices(tiny_llama.name, first_met, make_default=True)
    assert saved == {"targets": {met["level"]: 1000.0}, "default_level": met["level"]}
    first_missed = {**document, "choices": [missed, met]}
    saved = save_choices(tiny_llama.name, first_missed, make_default=True)
    assert saved["default_level"] is None  # the default's target was not met: none is set
    assert codec_for("tcq", tiny_llama).default_level == codec.levels[len(codec.levels) // 2]
    path = tmp_path / "tcq-calibration.json"
    path.write_text(json.dumps(first_missed))
    assert read_calibration(path)["choices"] == first_missed["choices"]
    old = tmp_path / "version-1.json"  # written before unmet targets were kept
    old.write_text(json.dumps({**document, "version": 1}))
    assert read_calibration(old)["choices"] == document["choices"]


def test_when_no_target_is_met_the_run_says_so_and_keeps_its_measurements(
    document, tiny_llama, tmp_path, capsys
):
    save_choices(tiny_llama.name, document, make_default=True)
    record = tcq_levels_path(tiny_llama.identity()).read_bytes()
    argv = ["calibrate", "--codec", "tcq", "--model", "tiny-llama", "--target-ppl", "1e-9"]
    argv += ["--windows", "2", "--context-tokens", "96", "--continuation-tokens", "16"]
    assert main([*argv, "--out", str(tmp_path), "--no-progress"]) == 1
    assert "no tcq level kept the perplexity change within 1e-09%" in capsys.readouterr().err
    written = json.loads((tmp_path / "tcq-calibration.json").read_text())
    assert [c["level"] for c in written["choices"]] == [None]
    assert len(written["trials"]) == len(document["trials"])
    assert tcq_levels_path(tiny_llama.identity()).read_bytes() == record  # untouched


def test_a_damaged_record_is_refused(document, tiny_llama):
    save_choices(tiny_llama.name, document, make_default=False)
    codec = codec_for("tcq", tiny_llama)
    assert codec.default_level == codec.levels[len(codec.levels) // 2]  # none chosen
    path = tcq_levels_path(tiny_llama.identity())
    path.write_text(path.read_text()[:-20])
    with pytest.raises(CodecError, match="unreadable"):
        read_tcq_levels(tiny_llama.identity(), codec_for("tcq", tiny_llama).profile_id)
    path.unlink()


def ship(spec, tcq_entry: dict, directory, monkeypatch) -> dict:
    """A shipped calibration of ``spec`` with ``tcq_entry``, in ``directory`` as the package's."""
    shipped = {
        "schema": "cachegen-calibrated-levels",
        "version": 1,
        "model": {"name": spec.name, "fingerprint": spec.identity().fingerprint},
        "default_level": 2,
        "levels": {},
        "tcq": tcq_entry,
    }
    (directory / "tiny.json").write_text(json.dumps(shipped))
    monkeypatch.setattr(tcq_levels, "SHIPPED_DIR", directory)
    return shipped


def test_a_shipped_calibration_is_the_default_until_one_is_recorded(
    document, tiny_llama, tmp_path, monkeypatch
):
    codec = codec_for("tcq", tiny_llama)
    identity = tiny_llama.identity()
    tcq_levels_path(identity).unlink(missing_ok=True)
    tcq_entry = {"model_file": codec.profile_id, "targets": {"24": 2.0}, "default_level": 24}
    shipped = ship(tiny_llama, tcq_entry, tmp_path, monkeypatch)
    assert read_tcq_levels(identity, codec.profile_id) == {
        "targets": {24: 2.0},
        "default_level": 24,
    }
    assert codec_for("tcq", tiny_llama).default_level == 24
    assert read_tcq_levels(identity, "another-model-file") is None  # shipped for another fit

    recorded = save_choices(tiny_llama.name, document, make_default=True)
    assert read_tcq_levels(identity, codec.profile_id) == recorded  # this machine's wins
    tcq_levels_path(identity).unlink()

    shipped["tcq"]["default_level"] = 25  # not one of its targets
    (tmp_path / "tiny.json").write_text(json.dumps(shipped))
    with pytest.raises(CodecError, match="has no target"):
        read_tcq_levels(identity, codec.profile_id)


def test_a_shipped_calibration_counts_for_a_model_file_of_its_recipe(
    tiny_llama, tmp_path, monkeypatch
):
    # another CPU fits the same recipe into a model file with another id (its forward pass
    # rounds differently); the shipped choices still count for it, not for another recipe
    codec = codec_for("tcq", tiny_llama)
    identity = tiny_llama.identity()
    tcq_levels_path(identity).unlink(missing_ok=True)
    recipe = codec.tcq.calibration
    assert recipe == tcq_calibration_spec(spec=tiny_llama)
    choices = {"targets": {"24": 2.0}, "default_level": 24}
    tcq_entry = {"model_file": "fitted-on-another-cpu", "recipe": recipe, **choices}
    ship(tiny_llama, tcq_entry, tmp_path, monkeypatch)
    assert codec_for("tcq", tiny_llama).default_level == 24
    assert codec.calibrated_levels() == {"targets": {24: 2.0}, "default_level": 24}
    other = {**recipe, "radius_margin": recipe["radius_margin"] + 1}
    assert read_tcq_levels(identity, codec.profile_id, other) is None
    assert read_tcq_levels(identity, codec.profile_id) is None  # no recipe given


def test_the_shipped_tcq_calibrations_are_of_the_current_recipe():
    # a changed recipe refits every model file, and a shipped calibration of the old recipe
    # would then count nowhere: calibrate again and ship the new choices with the new recipe
    shipped = [json.loads(path.read_text()) for path in sorted(SHIPPED_DIR.glob("*.json"))]
    entries = [(data["model"]["name"], data["tcq"]) for data in shipped if data.get("tcq")]
    assert {name for name, _ in entries} == {"smollm2-135m", "gemma3-270m"}
    for name, entry in entries:
        assert entry["recipe"] == tcq_calibration_spec(spec=models.resolve(name)), name


def test_a_models_layer_exponent_is_its_own_or_the_default():
    gemma = tcq_calibration_spec(spec=models.resolve("gemma3-270m"))
    smollm2 = tcq_calibration_spec(spec=models.resolve("smollm2-135m"))
    assert gemma["layer_exponent"] == 0.5 and smollm2["layer_exponent"] == 1.0
    assert {**gemma, "layer_exponent": 1.0} == smollm2  # nothing else differs


def test_choosing_again_reorders_targets_on_the_measured_levels(
    document, tiny_llama, tmp_path, capsys
):
    path = tmp_path / "tcq-calibration.json"
    path.write_text(json.dumps({**document, "saved": {"targets": {}, "default_level": 99}}))
    again = choose_tcq_again(tiny_llama.name, path, CalibrationSettings(targets=(2000.0, 1e-9)))
    assert again["trials"] == document["trials"] and again["windows"] == document["windows"]
    assert [c["target_ppl_pct"] for c in again["choices"]] == [2000.0, 1e-9]
    assert again["choices"][0]["level"] == document["choices"][0]["level"]
    assert again["choices"][1]["level"] is None  # unmet on the same levels
    assert "saved" not in again  # the earlier run's record is not this choice's
    argv = ["calibrate", "--codec", "tcq", "--model", "tiny-llama", "--trials", str(path)]
    out = tmp_path / "again"
    assert main([*argv, "--target-ppl", "1000", "--set-default", "--out", str(out)]) == 0
    cheapest = codec_for("tcq", tiny_llama).levels[0]
    assert f"level {cheapest} is the tcq default" in capsys.readouterr().out
    assert json.loads((out / "tcq-calibration.json").read_text())["trials"] == document["trials"]
    assert main([*argv, "--apply", str(path)]) != 0
    assert "alternatives" in capsys.readouterr().err
    with pytest.raises(InputError, match="not smollm2-135m"):
        choose_tcq_again("smollm2-135m", path, CalibrationSettings())


@pytest.mark.parametrize("flag", [["--level", "7"], ["--no-derotate"]])
def test_cachegen_only_flags_are_refused_with_tcq(flag, capsys):
    assert main(["calibrate", "--codec", "tcq", "--model", "tiny-llama", *flag]) != 0
    assert "calibrate cachegen levels" in capsys.readouterr().err
