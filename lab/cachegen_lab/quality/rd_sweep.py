"""Rate-distortion sweep: every codec, every level, and codec options beyond the levels.

The grid holds the baselines (raw, int8, fp8, int8-zstd, KIVI-style 2-bit, and every level
of the transform codecs KVTC and TurboQuant), every level of the model's cachegen profile
(the paper's three and any calibrated ones), and cachegen configurations that are not levels
(uniform bins with each scale granularity, with and without the Hadamard rotation, token
locality), all encoded and decoded by the real codec so bits/element counts every byte. The
result is annotated with the Pareto frontier and with the quality targets (docs/quality.md,
"Against the targets").
"""

from __future__ import annotations

from cachegen.codec import available_codecs
from cachegen.models import ModelSpec
from cachegen.profiles import codec_for
from cachegen_lab.quality.candidates import codec_candidates, variant_candidate, variants
from cachegen_lab.quality.evaluate import Candidate

BASELINES = (
    "raw",
    "int8",
    "int8-zstd",
    "fp8",
    "kivi2",
    "kvtc",
    "turboquant",
)  # int8 next to int8-zstd: same decoded KV, one run


def grid(spec: ModelSpec, *, include_variants: bool = True) -> list[Candidate]:
    candidates = []
    for name in BASELINES:
        if name in available_codecs():
            candidates += codec_candidates(spec, name, None)
    profile_levels = codec_candidates(spec, "cachegen", None)
    codec = codec_for("cachegen", spec)
    for candidate in profile_levels:
        config = codec.profile.config(int(candidate.level))
        candidate.options = config.to_dict()
    candidates += profile_levels
    if include_variants:
        candidates += [
            variant_candidate(spec, name, config) for name, config in variants(spec).items()
        ]
    return candidates


def check_targets(rows: list[dict], *, max_bits: float = 2.5, max_ppl_pct: float = 2.0) -> dict:
    """The quality targets (docs/quality.md), read off annotated rows (``frontier.annotate``)."""
    cheap = [
        r for r in rows if r["bits_per_element"] <= max_bits and r["ppl_change_pct"] <= max_ppl_pct
    ]
    best = min(cheap, key=lambda r: (r["ppl_change_pct"], r["bits_per_element"]), default=None)
    references = [
        r
        for r in rows
        if (r["codec"] == "cachegen" and r["level"] in ("1", "2", "3")) or r["codec"] == "kivi2"
    ]
    return {
        f"operating_point_le_{max_bits}_bits_le_{max_ppl_pct}_pct": None
        if best is None
        else {
            "codec": best["codec"],
            "level": best["level"],
            "bits_per_element": best["bits_per_element"],
            "ppl_change_pct": best["ppl_change_pct"],
        },
        "frontier_dominates": {
            f"{r['codec']}/{r['level']}": r.get("dominated_by", []) for r in references
        },
    }
