"""The quality loss of each stored form of a model's KV, for a bound on it (``max_loss_pct``).

A *form* (``cachegen.modes.Form``, named by its label) is how a chunk is stored:
``cachegen-<L>`` (the cachegen codec at level L, coded), ``cachegen-<L>-packed`` (the same
symbols in the packed form), ``tcq-<L>`` and ``tcq-<L>-packed`` (the transform codec at level
L, coded or packed), ``raw``, ``int8`` or ``fp8``. Its loss is a perplexity change in percent:

* a cachegen level: its calibration target (``target_ppl_pct`` in
  ``cachegen/codec/calibrated/*.json``); the packed form decodes to the same KV, so it has its
  coded level's loss; a level that is not a shipped calibrated one has no known loss;
* ``raw``: 0 (lossless);
* ``int8``, ``fp8``: measured per model, in ``form_loss.json`` next to this module (its
  ``source`` says which command measured them); unknown for a model it does not list;
* a tcq level: the perplexity target that ``cachegen calibrate --codec tcq`` found it to meet
  on the calibration windows (``cachegen.codec.tcq.levels``); unknown when no calibration
  chose it. Its packed form decodes to the same KV: its coded level's loss.

Unknown is ``None``: a bound never allows such a form.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from cachegen.codec.shipped import read_versioned, shipped_calibration
from cachegen.modes import CACHEGEN, LOSSLESS, TCQ, Form

LOSS_FILE = Path(__file__).with_name("form_loss.json")
LOSS_SCHEMA = "cachegen-form-loss"
LOSS_VERSION = 1


def calibrated_losses(fingerprint: str) -> dict[int, float]:
    """``target_ppl_pct`` per shipped calibrated cachegen level of the model with weights
    ``fingerprint`` (``ModelIdentity.fingerprint``); empty for a model without a calibration."""
    doc = shipped_calibration(fingerprint) or {"levels": {}}
    return {
        int(level): float(entry["target_ppl_pct"])
        for level, entry in doc["levels"].items()
        if "target_ppl_pct" in entry
    }


def baseline_losses(fingerprint: str) -> dict[str, float]:
    """The measured losses of the baseline codecs (``int8``, ``fp8``) for the model with
    weights ``fingerprint``, from ``form_loss.json``; empty for a model it does not list."""
    doc = read_versioned(LOSS_FILE, LOSS_SCHEMA, LOSS_VERSION)
    for entry in doc["models"].values():
        if entry["fingerprint"] == fingerprint:
            return {name: float(value) for name, value in entry["loss_pct"].items()}
    return {}


def form_losses(
    names: Iterable[str],
    fingerprint: str,
    calibrated_levels: Iterable[int] | None = None,
    tcq_targets: dict[int, float] | None = None,
) -> dict[str, float | None]:
    """Each form's loss (None: unknown; module docs), by label, for the model with weights
    ``fingerprint``. ``calibrated_levels`` (e.g. ``Profile.calibrated_levels()``), when
    given, are the only cachegen levels whose calibration target counts: a profile whose level
    differs from the shipped one (rebuilt, or another calibration) has no known loss there.
    ``tcq_targets``: the calibrated targets of the model's current tcq model file
    (``cachegen.codec.tcq.levels.read_tcq_levels``)."""
    levels = calibrated_losses(fingerprint)
    if calibrated_levels is not None:
        keep = set(calibrated_levels)
        levels = {lv: loss for lv, loss in levels.items() if lv in keep}
    baselines = baseline_losses(fingerprint)
    out: dict[str, float | None] = {}
    for name in names:
        form = Form.parse(name)
        if form.codec == CACHEGEN:
            out[name] = levels.get(form.level)
        elif form.codec == TCQ:
            out[name] = (tcq_targets or {}).get(form.level)
        elif name in LOSSLESS:
            out[name] = 0.0
        else:
            out[name] = baselines.get(name)
    return out
