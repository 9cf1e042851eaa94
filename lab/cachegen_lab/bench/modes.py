"""Groups of modes (``cachegen.modes``) that the bench takes as input besides single modes,
expanded for one model at a time.

``baseline`` = recompute raw int8 fp8; ``cachegen`` = the paper's levels 1-3 plus the model's
default level, plus adaptive (the earlier reproduction's ``--modes baseline cachegen``);
``tcq`` = the model's tcq default level, the mode a request that names none loads, plus
``adaptive-fastest`` (the fastest stored form of the connector's default save ladder within
the default level's calibration target, :func:`tcq_default`), for a model that ships a tcq
calibration with a default level (nothing for one that does not); ``all`` = the three. Other
levels of a profile (calibration may add several) are measured when named, e.g.
``cachegen-5``, and so are the lab's peer codecs (``cachegen_lab.peers``: ``lmcache-cachegen``,
LMCache's CacheGen). ``mode_name`` is a mode's name in tables and figures.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from cachegen.errors import InputError
from cachegen.modes import (
    ADAPTIVE,
    ADAPTIVE_FASTEST,
    CACHEGEN,
    CODED,
    KV_BASELINES,
    PACKED,
    RECOMPUTE,
    TCQ,
    Form,
    Mode,
    all_modes,
)

BASELINE = (RECOMPUTE, *KV_BASELINES)
PAPER_LEVELS = (1, 2, 3)


@dataclass(frozen=True)
class TcqDefault:
    """A model's tcq default level and the perplexity change (%) it was calibrated to keep
    within: ``adaptive-fastest``'s quality bound."""

    level: int
    target_pct: float


@functools.cache
def tcq_default(model: str) -> TcqDefault | None:
    """``model``'s tcq default level and its calibration target, where the model ships a tcq
    calibration with a default level (the connector's default mode is then tcq,
    ``cachegen.connector.config.default_mode``); None for every other model."""
    from cachegen import models
    from cachegen.codec.shipped import ships_tcq_default
    from cachegen.profiles import codec_for

    if not ships_tcq_default(models.resolve(model).identity().fingerprint):
        return None
    calibration = codec_for(TCQ, model).calibrated_levels()
    if not calibration or calibration["default_level"] is None:
        return None  # a model file this machine fitted anew: no calibrated targets
    level = calibration["default_level"]
    return TcqDefault(level, calibration["targets"][level])


def codec_levels(model: str | None) -> tuple[int, ...]:
    """The paper's levels and ``model``'s default level, as its codec profile defines them
    (the paper's levels without a model)."""
    if model is None:
        return PAPER_LEVELS
    from cachegen.profiles import codec_for

    codec = codec_for(CACHEGEN, model)
    paper = {level for level in codec.levels if level in PAPER_LEVELS}
    return tuple(sorted(paper | {codec.default_level}))


def expand(labels: list[str], model: str | None = None) -> list[Mode]:
    """Modes of ``model`` for labels and groups, deduplicated, in a stable order. The groups
    take their levels from ``model``'s codec profiles (without a model: the paper's levels
    1-3, and no tcq level)."""
    if not labels:
        raise InputError("no modes given; try --modes baseline cachegen tcq")
    out: list[Mode] = []
    for label in labels:
        if label == "all":
            out += expand(["baseline", "cachegen", "tcq"], model)
        elif label == "baseline":
            out += [Mode(m) for m in BASELINE]
        elif label == CACHEGEN:
            out += [Mode(CACHEGEN, level) for level in codec_levels(model)] + [Mode(ADAPTIVE)]
        elif label == TCQ:
            default = tcq_default(model) if model is not None else None
            out += [Mode(TCQ, default.level), Mode(ADAPTIVE_FASTEST)] if default else []
        else:
            out.append(Mode.parse(label))
    return list(dict.fromkeys(out))


def union(mode_lists: Iterable[list[Mode]]) -> list[Mode]:
    """Every mode of ``mode_lists`` once, in the vocabulary's order (``cachegen.modes.all_modes``:
    recompute, the baselines, cachegen's levels, tcq's, adaptive, adaptive-fastest, the peer
    codecs), levels ascending."""
    every = {mode for modes in mode_lists for mode in modes}
    order = all_modes()
    return sorted(every, key=lambda m: (order.index(m.mode), m.level or 0))


OLD_PACKED_BIT = 1 << 15  # how documents of earlier releases named a packed form: a number


def mode_name(mode: str, level: int | str | None) -> str:
    """A table's name for a mode at a level (a number: coded) or in a form (its name):
    ``int8``, ``cachegen level 11``, ``cachegen level 11 packed``."""
    return mode if level is None else f"{mode} level {_level_name(mode, level)}"


def _level_name(mode: str, level: int | str) -> str:
    """``11``, or ``11 packed`` for a packed form (by its name; in documents of earlier
    releases, by its level with bit 15 set)."""
    if isinstance(level, int):
        if level < OLD_PACKED_BIT:
            return str(level)
        form = Form(mode, level & ~OLD_PACKED_BIT, PACKED)
    else:
        form = Form.parse(level)
    return str(form.level) if form.packing == CODED else f"{form.level} {form.packing}"
