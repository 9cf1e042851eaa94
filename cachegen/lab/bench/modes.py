"""Groups of modes (``cachegen.modes``) that the bench takes as input besides single modes.

``baseline`` = recompute raw int8 fp8; ``cachegen`` = the paper's levels 1-3 plus each
model's default level, plus adaptive (the earlier reproduction's ``--modes baseline
cachegen``); ``all`` = both. Other levels of a profile (calibration may add several) are
measured when named, e.g. ``cachegen-5``. ``mode_name`` is a mode's name in tables and
figures.
"""

from __future__ import annotations

from cachegen.errors import InputError
from cachegen.modes import CACHEGEN, CODED, KV_BASELINES, RECOMPUTE, Form, Mode

BASELINE = (RECOMPUTE, *KV_BASELINES)
PAPER_LEVELS = (1, 2, 3)


def codec_levels(models: list[str] | None) -> tuple[int, ...]:
    """The paper's levels and each model's default level, as the models' codec profiles define
    them."""
    if not models:
        return PAPER_LEVELS
    from cachegen.profiles import codec_for

    levels: set[int] = set()
    for model in models:
        codec = codec_for("cachegen", model)
        levels |= {level for level in codec.levels if level in PAPER_LEVELS} | {codec.default_level}
    return tuple(sorted(levels))


def expand(labels: list[str], models: list[str] | None = None) -> list[Mode]:
    """Modes for labels and groups, deduplicated, in a stable order. The ``cachegen`` group
    takes its levels from the codec profiles of ``models`` (the paper's 1-3 without models)."""
    if not labels:
        raise InputError("no modes given; try --modes baseline cachegen")
    out: list[Mode] = []
    for label in labels:
        if label == "all":
            out += expand(["baseline", "cachegen"], models)
        elif label == "baseline":
            out += [Mode(m) for m in BASELINE]
        elif label == "cachegen":
            out += [Mode("cachegen", level) for level in codec_levels(models)] + [Mode("adaptive")]
        else:
            out.append(Mode.parse(label))
    seen: dict[Mode, None] = {}
    for mode in out:
        seen.setdefault(mode, None)
    return list(seen)


def mode_name(mode: str, level: int | None) -> str:
    """A table's name for a mode: ``int8``, ``cachegen level 11``, ``cachegen level 11 packed``."""
    return mode if level is None else f"{mode} level {_level_name(level)}"


def _level_name(level: int) -> str:
    """A stored cachegen level: ``11``, or ``11 packed`` for its packed form's store slot."""
    form = Form.from_slot(CACHEGEN, level)
    return str(level) if form.packing == CODED else f"{form.level} {form.packing}"
