"""Rate-distortion sweep: every codec, every level, and codec options beyond the levels.

The grid holds the baselines (raw, int8, fp8, int8-zstd, KIVI-style 2-bit), every level of
the model's cachegen profile (the paper's three and any calibrated ones), and cachegen
configurations that are not levels (uniform bins with each scale granularity, with and
without the Hadamard rotation, token locality), all encoded and decoded by the real codec
so bits/element counts every byte. The result is annotated with the Pareto frontier and
with the issue's targets.
"""

from __future__ import annotations

from dataclasses import replace

from cachegen.codec import QuantConfig, available_codecs, get_codec, paper_levels
from cachegen.models import ModelSpec, rope_theta
from cachegen.quality.candidates import codec_candidates, codec_roundtrip, config_codec
from cachegen.quality.evaluate import Candidate

BASELINES = ("raw", "int8", "int8-zstd", "fp8", "kivi2")  # int8 next to int8-zstd: same decoded KV, one run
VARIANT_LEVEL = 0xFFFF  # level number written into variant bitstreams (they are not profile levels)


def variants(spec: ModelSpec) -> dict[str, QuantConfig]:
    """Named cachegen configurations swept besides the profile's levels (``cachegen eval
    --codec cachegen:NAME`` takes them too)."""
    L = spec.identity().num_layers
    theta = rope_theta(spec.config)

    def uniform(bins: int, key_scale: str, value_scale: str, hadamard: bool) -> QuantConfig:
        return QuantConfig((bins,) * L, (bins,) * L, key_scale, value_scale, hadamard)

    def ablation(name: str, config: QuantConfig) -> dict[str, QuantConfig]:
        """``config`` alone, with the first token exact, with keys turned back by their
        rotary angles, and with both (models without RoPE: the first two only)."""
        out = {name: config, f"{name}+sink": replace(config, exact_tokens=1)}
        if theta:
            out[f"{name}+rope"] = replace(config, rope_theta=theta)
            out[f"{name}+rope+sink"] = replace(config, rope_theta=theta, exact_tokens=1)
        return out

    paper2 = paper_levels(L)[2]
    k16_v6 = QuantConfig((16,) * L, (6,) * L, "token", "token-head", hadamard=True)
    k32_v6 = QuantConfig((32,) * L, (6,) * L, "token", "token-head", hadamard=False)
    return {
        # the paper's level 2 with its token-wise locality (anchors + deltas) switched on
        "p2-locality": QuantConfig(paper2.key_bins, paper2.value_bins, group_size=10),
        # NOTES.md's best hand-made scheme: keys scaled per channel, values per token and head
        "kch-vth-16": uniform(16, "channel", "token-head", False),
        # Hadamard rotation with uniform bins: what calibration's per-layer allocation must beat
        "had-th-12": uniform(12, "token-head", "token-head", True),
        "had-th-16": uniform(16, "token-head", "token-head", True),
        # what pre-RoPE keys and an exact first token each buy, on two configurations: keys
        # 16 / values 6 bins with Hadamard (the earlier level 8) and keys 32 / values 6 without
        **ablation("had-k16-vth6", k16_v6),
        **ablation("k32-vth6", k32_v6),
    }


def variant_candidate(spec: ModelSpec, name: str, config: QuantConfig) -> Candidate:
    codec = config_codec(spec, config, VARIANT_LEVEL)
    return Candidate("cachegen", name, codec_roundtrip(codec, VARIANT_LEVEL), options=config.to_dict())


def grid(spec: ModelSpec, *, include_variants: bool = True) -> list[Candidate]:
    candidates = []
    for name in BASELINES:
        if name in available_codecs():
            candidates += codec_candidates(spec, name, None)
    profile_levels = codec_candidates(spec, "cachegen", None)
    codec = get_codec("cachegen", model=spec)
    for candidate in profile_levels:
        config = codec.profile.config(int(candidate.level))
        candidate.options = config.to_dict()
    candidates += profile_levels
    if include_variants:
        candidates += [variant_candidate(spec, name, config) for name, config in variants(spec).items()]
    return candidates


def check_targets(rows: list[dict], *, max_bits: float = 2.5, max_ppl_pct: float = 2.0) -> dict:
    """The issue's targets, read off annotated rows (see ``frontier.annotate``)."""
    cheap = [r for r in rows if r["bits_per_element"] <= max_bits and r["ppl_change_pct"] <= max_ppl_pct]
    best = min(cheap, key=lambda r: (r["ppl_change_pct"], r["bits_per_element"]), default=None)
    references = [r for r in rows if (r["codec"] == "cachegen" and r["level"] in ("1", "2", "3")) or r["codec"] == "kivi2"]
    return {
        f"operating_point_le_{max_bits}_bits_le_{max_ppl_pct}_pct": None
        if best is None
        else {"codec": best["codec"], "level": best["level"], "bits_per_element": best["bits_per_element"],
              "ppl_change_pct": best["ppl_change_pct"]},
        "frontier_dominates": {f"{r['codec']}/{r['level']}": r.get("dominated_by", []) for r in references},
    }
