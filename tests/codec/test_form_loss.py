"""The quality loss of each stored form (cachegen.codec.form_loss), read from the shipped data."""

from __future__ import annotations

import json

import pytest

from cachegen.codec import form_loss
from cachegen.codec.cachegen.profile import SHIPPED_DIR
from cachegen.errors import InputError


def test_smollm2_losses_come_from_its_calibration_and_the_measured_baselines(smollm2):
    fingerprint = smollm2.identity().fingerprint
    shipped = json.loads((SHIPPED_DIR / "smollm2-135m.json").read_text())
    default = shipped["default_level"]
    target = shipped["levels"][str(default)]["target_ppl_pct"]
    measured = json.loads(form_loss.LOSS_FILE.read_text())["models"]["smollm2-135m"]["loss_pct"]
    names = [f"cachegen-{default}", f"cachegen-{default}-packed", "cachegen-1", "raw", "int8"]
    names.append("fp8")
    losses = form_loss.form_losses(names, fingerprint)
    assert losses == {
        f"cachegen-{default}": target,
        f"cachegen-{default}-packed": target,  # the same symbols, the same KV
        "cachegen-1": None,  # a paper preset, not a calibrated level: unknown
        "raw": 0.0,
        "int8": measured["int8"],
        "fp8": measured["fp8"],
    }
    # a profile whose level is not the shipped one has no known loss there
    assert form_loss.form_losses([f"cachegen-{default}"], fingerprint, []) == {
        f"cachegen-{default}": None
    }


def test_a_tcq_levels_packed_form_has_its_coded_levels_target(smollm2):
    fingerprint = smollm2.identity().fingerprint
    shipped = json.loads((SHIPPED_DIR / "smollm2-135m.json").read_text())["tcq"]
    targets = {int(level): pct for level, pct in shipped["targets"].items()}
    default = shipped["default_level"]
    names = [f"tcq-{default}", f"tcq-{default}-packed", "tcq-20-packed"]
    losses = form_loss.form_losses(names, fingerprint, tcq_targets=targets)
    assert losses == {
        f"tcq-{default}": targets[default],
        f"tcq-{default}-packed": targets[default],  # the same symbols, the same KV
        "tcq-20-packed": None,  # no calibration chose level 20: unknown, coded or packed
    }
    assert form_loss.form_losses([f"tcq-{default}-packed"], fingerprint) == {
        f"tcq-{default}-packed": None  # no targets for the model file in use
    }


def test_a_model_without_data_has_only_raw_known(tiny_llama):
    losses = form_loss.form_losses(
        ["cachegen-2", "int8", "fp8", "raw"], tiny_llama.identity().fingerprint
    )
    assert losses == {"cachegen-2": None, "int8": None, "fp8": None, "raw": 0.0}
    with pytest.raises(InputError, match="unknown form 'cachegen-x'"):
        form_loss.form_losses(["cachegen-x"], tiny_llama.identity().fingerprint)


def test_the_loss_file_is_a_versioned_document_with_its_source():
    doc = json.loads(form_loss.LOSS_FILE.read_text())
    assert (doc["schema"], doc["version"]) == (form_loss.LOSS_SCHEMA, form_loss.LOSS_VERSION)
    assert all(entry["source"] for entry in doc["models"].values())


def test_a_loss_file_of_another_schema_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "form_loss.json"
    bad.write_text(json.dumps({"schema": "something-else", "version": 1}))
    monkeypatch.setattr(form_loss, "LOSS_FILE", bad)
    with pytest.raises(InputError, match="not 'cachegen-form-loss'"):
        form_loss.baseline_losses("0" * 64)
