"""Quality targets for the tcq levels: ``cachegen calibrate --codec tcq``.

A tcq level is a number of bits per element on the calibration text (``cachegen.codec.tcq.codec``),
so calibrating it needs no allocation search: every level of the model's tcq model file runs
for real on the calibration windows (the ``calibrate`` split of the pydoc text, the windows
and the model run of ``cachegen calibrate``), and each perplexity target takes the cheapest
level that meets it by the same rule as the cachegen levels (``select`` ``kl``: KL within the
budget the target maps to by regressing perplexity change on KL over the levels, and
perplexity change within the target; ``ppl``: perplexity change within margin x target).

The choices are recorded for that model file (``cachegen.codec.tcq.levels``): they become
the levels' losses for a quality bound (the connector's ``max_loss_pct``) and, with
``set_default``, the first target's level becomes the codec's default. A target no level
meets is a result too, not an error: its choice has no level and says why (``unmet``), and
the measured levels and the other targets' choices are kept.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from cachegen.codec import decode, inspect
from cachegen.errors import InputError
from cachegen.fileio import check_version, versioned
from cachegen_lab.quality.calibrate import (
    CalibrationSettings,
    CalibrationWindows,
    checked_settings,
    within_target,
)

SCHEMA = "cachegen-tcq-calibration"
VERSION = 2  # 2: a choice may have no level (an unmet target); 1 files still read


@dataclass
class LevelTrial:
    """One tcq level measured on the calibration windows."""

    level: int
    bits_per_element: float  # through the codec, everything counted
    kl: float = math.nan
    ppl_change_pct: float = math.nan
    top1_agreement: float = math.nan

    def to_dict(self) -> dict:
        return asdict(self)


def calibrate_tcq(
    model: str, settings: CalibrationSettings | None = None, *, progress: bool = True
) -> dict:
    """Measure every tcq level of ``model`` on the calibration windows and choose one per
    target of ``settings.targets``; the result document (schema ``cachegen-tcq-calibration``)."""
    from cachegen.profiles import codec_for

    settings = checked_settings(settings)
    data = CalibrationWindows(model, settings, progress)
    codec = codec_for("tcq", data.spec, chunk_tokens=settings.chunk_tokens)
    trials = []
    elements = sum(kv.num_elements for kv, _, _ in data.items)
    for level in codec.levels:
        bits = sum(
            inspect(codec.encode(kv, level=level))["bits_per_element"] * kv.num_elements
            for kv, _, _ in data.items
        )
        trials.append(LevelTrial(level, bits / elements))
    variants = [
        (lambda n, kv, level=t.level: decode(codec.encode(kv, level), out_dtype=kv.keys.dtype))
        for t in trials
    ]
    for trial, (kl, ppl, agree) in zip(trials, data.score(variants, "tcq levels")):
        trial.kl, trial.ppl_change_pct, trial.top1_agreement = kl, ppl, agree
    choices = [_choice_or_unmet(trials, target, settings) for target in settings.targets]
    identity = data.spec.identity()
    return versioned(
        SCHEMA,
        VERSION,
        {
            "model": {"name": identity.name, "fingerprint": identity.fingerprint},
            "tcq_model": codec.profile_id,
            "tcq_recipe": codec.tcq.calibration,
            "split": "calibrate",
            "windows": settings.windows,
            "context_tokens": settings.context_tokens,
            "continuation_tokens": settings.continuation_tokens,
            "seed": settings.seed,
            "chunk_tokens": settings.chunk_tokens,
            "dtype": str(settings.dtype).removeprefix("torch."),
            "select": settings.select,
            "margin": settings.margin,
            "choices": choices,
            "trials": [t.to_dict() for t in trials],
        },
    )


def choose_tcq_again(model: str, path, settings: CalibrationSettings | None = None) -> dict:
    """An earlier run's document (its ``tcq-calibration.json``) with its levels chosen again
    for ``settings.targets`` (by ``settings.select`` and ``margin``), without measuring them
    again: the windows and the measured levels are the earlier run's."""
    from cachegen.models import resolve

    settings = checked_settings(settings)
    document = read_calibration(path)
    if document["model"]["fingerprint"] != resolve(model).identity().fingerprint:
        raise InputError(f"{path} calibrated {document['model']['name']}, not {model}")
    try:
        trials = [LevelTrial(**trial) for trial in document["trials"]]
    except TypeError as exc:
        raise InputError(f"{path} has a malformed level trial: {exc}") from exc
    choices = [_choice_or_unmet(trials, target, settings) for target in settings.targets]
    measured = {k: v for k, v in document.items() if k != "saved"}  # what it recorded then
    return {**measured, "select": settings.select, "margin": settings.margin, "choices": choices}


def choose_level(trials: list[LevelTrial], target: float, settings: CalibrationSettings) -> dict:
    """The cheapest level of ``trials`` that meets ``target`` (module docs)."""
    slope, budget, within = within_target(trials, target, settings, "tcq level")
    chosen = min(within, key=lambda t: t.bits_per_element)
    return {
        "target_ppl_pct": target,
        "level": chosen.level,
        "kl_budget": budget,
        "ppl_pct_per_kl": slope,
    }


def _choice_or_unmet(trials: list[LevelTrial], target: float, settings) -> dict:
    try:
        return choose_level(trials, target, settings)
    except InputError as exc:
        return {"target_ppl_pct": target, "level": None, "unmet": str(exc)}


def unmet(document: dict) -> list[dict]:
    """The choices of ``document`` whose target no level met."""
    return [choice for choice in document["choices"] if choice["level"] is None]


def read_calibration(path) -> dict:
    """An earlier run's ``tcq-calibration.json``, checked."""
    import json

    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read tcq calibration {path}: {exc}") from exc
    document = check_version(document, SCHEMA, (1, VERSION), str(path))
    try:
        for choice in document["choices"]:
            float(choice["target_ppl_pct"])
            if choice["level"] is not None:
                int(choice["level"])
        str(document["tcq_model"]), str(document["model"]["fingerprint"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path} has a malformed entry: {exc!r}") from exc
    return document


def save_choices(model: str, document: dict, *, make_default: bool) -> dict:
    """Record ``document``'s choices for its tcq model file; the first target's level is the
    codec's default with ``make_default`` (none if no level met it). Each level keeps the
    strictest target it met; unmet targets record nothing."""
    from cachegen.codec.tcq.levels import write_tcq_levels
    from cachegen.models import resolve
    from cachegen.profiles import codec_for

    spec = resolve(model)
    identity = spec.identity()
    if identity.fingerprint != document["model"]["fingerprint"]:
        raise InputError(f"this tcq calibration is of {document['model']['name']}, not {model}")
    current = codec_for("tcq", spec).profile_id
    if document["tcq_model"] != current:
        raise InputError(
            f"this tcq calibration measured tcq model {document['tcq_model']}, but {model}'s "
            f"is now {current}; calibrate again"
        )
    targets: dict[int, float] = {}
    for choice in document["choices"]:
        if choice["level"] is None:
            continue
        level = int(choice["level"])
        targets[level] = min(targets.get(level, math.inf), float(choice["target_ppl_pct"]))
    first = document["choices"][0]["level"]
    default = int(first) if make_default and first is not None else None
    settings = {k: v for k, v in document.items() if k not in ("choices", "trials")}
    write_tcq_levels(identity, document["tcq_model"], targets, default, settings)
    return {"targets": targets, "default_level": default}
