"""Benchmark modes: the ways a server can get a context's KV, named by plain labels.

Labels are what the CLI, results.json's config and the asv parameters use:
  ``recompute``      vLLM prefills the whole prompt from text (no KV is loaded)
  ``raw``            16-bit KV as vLLM holds it, loaded through the CacheGenConnector
  ``int8``, ``fp8``  the quantization baselines, loaded through the connector
  ``cachegen-<L>``   the CacheGen codec at quality level L
  ``cachegen``       (input only) the paper's levels 1-3 plus the model's default level
  ``adaptive``       CacheGen with per-chunk level choice under a load-time budget
Groups (input only): ``baseline`` = recompute raw int8 fp8; ``cachegen`` = those levels plus
adaptive (the earlier reproduction's ``--modes baseline cachegen``); ``all`` = both. Other
levels of a profile (calibration may add several) are measured when named, e.g. ``cachegen-5``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachegen.errors import InputError

KV_BASELINES = ("raw", "int8", "fp8")
BASELINE = ("recompute", *KV_BASELINES)
PAPER_LEVELS = (1, 2, 3)


@dataclass(frozen=True, order=True)
class Mode:
    mode: str  # recompute | raw | int8 | fp8 | cachegen | adaptive
    level: int | None = None

    @property
    def label(self) -> str:
        return f"{self.mode}-{self.level}" if self.level is not None else self.mode

    @property
    def moves_kv(self) -> bool:
        return self.mode != "recompute"

    @property
    def codec_name(self) -> str | None:
        """The codec that encodes this mode's KV (None: recompute; adaptive mixes levels)."""
        return None if self.mode in ("recompute", "adaptive") else self.mode

    @classmethod
    def parse(cls, label: str) -> "Mode":
        if label in BASELINE or label == "adaptive":
            return cls(label)
        prefix, _, level = label.partition("-")
        if prefix == "cachegen" and level.isdigit():
            return cls("cachegen", int(level))
        raise InputError(
            f"unknown mode {label!r}; use recompute, raw, int8, fp8, cachegen-<level>, adaptive, "
            f"or the groups baseline, cachegen, all"
        )


def codec_levels(models: list[str] | None) -> tuple[int, ...]:
    """The paper's levels and each model's default level, as the models' codec profiles define them."""
    if not models:
        return PAPER_LEVELS
    from cachegen.codec import get_codec

    levels: set[int] = set()
    for model in models:
        codec = get_codec("cachegen", model=model)
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
