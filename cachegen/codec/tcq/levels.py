"""Which tcq levels meet which quality targets: the choices of ``cachegen calibrate --codec
tcq``, kept next to the model's cachegen profile (``tcq-levels.json``).

A tcq level is a number of bits per element on the calibration text (``cachegen.codec.tcq.codec``);
what it costs in quality is measured on the calibration windows. A calibration records, for
the tcq model file it measured (its id), each perplexity target with the cheapest level that
met it, and optionally the level to use by default. They count only while that model file is
the model's current one: a refitted model file has no known targets until it is calibrated.

The targets are the levels' losses for a quality bound (``cachegen.codec.form_loss``): a
level chosen for a target of 1% is a form of loss 1%.

A model's calibration may also ship with the package (the ``tcq`` entry of its
``cachegen/codec/calibrated/<model>.json``), so that a fresh install gets a calibrated
default; a calibration run on this machine takes precedence. A shipped calibration counts for
the model file it measured and for any model file fitted by the same recipe (the model file's
``calibration``: text, levels, fitting settings, less its cross-layer prediction, which never
changes what a level decodes to): the fit runs the model's forward pass, whose float rounding
differs between CPUs (bf16 kernels with and without AMX), so a model file fitted here from the
same recipe has another id while its steps and tables differ only by that rounding.
"""

from __future__ import annotations

import json

from cachegen.codec.cachegen.profile import (
    SHIPPED_DIR,
    SHIPPED_SCHEMA,
    SHIPPED_VERSION,
    profile_path,
)
from cachegen.codec.errors import CodecError
from cachegen.errors import CacheGenError
from cachegen.fileio import check_version, versioned, write_atomic
from cachegen.kv import ModelIdentity

SCHEMA = "cachegen-tcq-levels"
VERSION = 1


def tcq_levels_path(model: ModelIdentity):
    return profile_path(model).parent / "tcq-levels.json"


def read_tcq_levels(
    model: ModelIdentity, model_file: str, recipe: dict | None = None
) -> dict | None:
    """``{"targets": {level: target_ppl_pct}, "default_level": int | None}`` calibrated for
    the tcq model file ``model_file`` (fitted by ``recipe``, its ``calibration``), or None
    (never calibrated, or for another model file and recipe)."""
    path = tcq_levels_path(model)
    if not path.is_file():
        return _shipped_tcq_levels(model, model_file, recipe)
    try:
        data = check_version(json.loads(path.read_text()), SCHEMA, (VERSION,), str(path))
        if str(data["model_file"]) != model_file:
            return _shipped_tcq_levels(model, model_file, recipe)
        return _parsed(data, path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CacheGenError) as exc:
        raise CodecError(
            f"tcq levels {path} are unreadable ({exc}); delete the file and calibrate again "
            "(`cachegen calibrate --codec tcq`)"
        ) from exc


def _shipped_tcq_levels(model: ModelIdentity, model_file: str, recipe: dict | None) -> dict | None:
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        data = check_version(
            json.loads(path.read_text()), SHIPPED_SCHEMA, (SHIPPED_VERSION,), str(path)
        )
        shipped = data.get("tcq")
        if data["model"]["fingerprint"] == model.fingerprint and shipped:
            same_file = str(shipped["model_file"]) == model_file
            same_recipe = recipe is not None and quantizer_recipe(
                shipped.get("recipe") or {}
            ) == quantizer_recipe(recipe)
            return _parsed(shipped, path) if same_file or same_recipe else None
    return None


def quantizer_recipe(recipe: dict) -> dict:
    """What of a model file's recipe sets the KV its levels decode to: all of it but the
    cross-layer prediction, which changes which symbols are coded, never their values
    (``cachegen.codec.tcq.predict``), so a level's measured quality holds with or without it."""
    return {key: value for key, value in recipe.items() if key != "prediction"}


def _parsed(data: dict, path) -> dict:
    try:
        targets = {int(level): float(pct) for level, pct in data["targets"].items()}
        default = data["default_level"]
        default = None if default is None else int(default)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CodecError(f"tcq levels in {path} are unreadable ({exc})") from exc
    if default is not None and default not in targets:
        raise CodecError(f"tcq levels {path}: the default level {default} has no target")
    return {"targets": targets, "default_level": default}


def write_tcq_levels(
    model: ModelIdentity,
    model_file: str,
    targets: dict[int, float],
    default_level: int | None,
    calibration: dict,
) -> None:
    """Record ``targets`` (level -> the perplexity target it met) of the tcq model file
    ``model_file``; ``calibration`` says how they were measured."""
    if default_level is not None and default_level not in targets:
        raise CodecError(f"the default tcq level {default_level} is not one of {sorted(targets)}")
    data = versioned(
        SCHEMA,
        VERSION,
        {
            "model_file": model_file,
            "targets": {str(level): pct for level, pct in sorted(targets.items())},
            "default_level": default_level,
            "calibration": calibration,
        },
    )
    write_atomic(tcq_levels_path(model), json.dumps(data, indent=1).encode() + b"\n")
