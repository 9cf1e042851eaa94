"""Codecs as evaluation candidates: encode with the real codec, decode the real bitstream.

The bits a candidate reports are ``inspect(blob)["bits_per_element"]`` times the number of
elements, i.e. everything in the bitstream (payload, tables, scales, headers) is counted.
"""

from __future__ import annotations

from dataclasses import replace

from cachegen.codec import QuantConfig, get_codec, paper_levels
from cachegen.errors import InputError
from cachegen.kv import KVCache
from cachegen.models import ModelSpec, rope_thetas
from cachegen_lab.quality.evaluate import Candidate

VARIANT_LEVEL = 0xFFFF  # level number written into variant bitstreams (they are not profile levels)


def codec_roundtrip(codec, level):
    from cachegen.codec import decode, inspect

    def run(kv: KVCache) -> tuple[KVCache, float]:
        blob = codec.encode(kv, level=level)
        return decode(blob), float(inspect(blob)["bits_per_element"]) * kv.num_elements

    return run


def config_codec(spec: ModelSpec, config, level: int):
    """A cachegen codec whose only level ``level`` is ``config``, through a profile that lives
    in memory: its probability tables are calibrated like any level's (and cached by content
    id), but the model's saved profile is not touched."""
    from cachegen.profiles import transient_profile

    return get_codec("cachegen", profile=transient_profile(spec, {level: config}))


def codec_candidates(spec: ModelSpec, name: str, levels: list[str] | None) -> list[Candidate]:
    """One candidate per requested level of codec ``name`` (``None``: all its levels); for
    cachegen a level may also name one of the sweep's variants, for tcq ``L-unrefined`` its
    level ``L`` without refined rows (:mod:`cachegen.codec.tcq.refine`)."""
    from cachegen.profiles import codec_for

    codec = codec_for(name, spec)
    available = {str(level): level for level in codec.levels}
    named = variants(spec) if name == "cachegen" else {}
    unrefined = None
    if name == "tcq":  # the same model file, without refined rows
        named = {f"{level}{UNREFINED}": level for level in codec.levels}
        unrefined = get_codec(name, tcq=codec.tcq, chunk_tokens=codec.chunk_tokens, refine=False)
    wanted = list(available) if levels is None else levels
    unknown = [level for level in wanted if level not in available and level not in named]
    if unknown:
        extra = f"; or one of the variants {', '.join(named)}" if named else ""
        raise InputError(
            f"codec {name} has no level {', '.join(unknown)}; its levels are "
            f"{', '.join(available) or '(none)'}{extra}"
        )
    return [_candidate(spec, name, (codec, unrefined), level, available, named) for level in wanted]


UNREFINED = "-unrefined"


def _candidate(spec, name, codecs, level: str, available: dict, named: dict) -> Candidate:
    """``codecs``: the codec, and for tcq the same without refined rows (else None)."""
    codec, unrefined = codecs
    if level in available:
        return Candidate(name, level, codec_roundtrip(codec, available[level]))
    if unrefined is not None:
        roundtrip = codec_roundtrip(unrefined, named[level])
        return Candidate(name, level, roundtrip, {"refine": False})
    return variant_candidate(spec, level, named[level])


def parse_codec_args(codecs: list[str], levels: str | None) -> list[tuple[str, list[str] | None]]:
    """``--codec NAME[:L1,L2]`` (repeatable) plus ``--levels`` for those without their own."""
    default = (
        None if levels in (None, "all") else [x.strip() for x in levels.split(",") if x.strip()]
    )
    out = []
    for item in codecs:
        name, _, own = item.partition(":")
        if not name:
            raise InputError(f"--codec {item!r} names no codec")
        out.append((name, [x.strip() for x in own.split(",") if x.strip()] if own else default))
    return out


def variants(spec: ModelSpec) -> dict[str, QuantConfig]:
    """Named cachegen configurations swept besides the profile's levels (``cachegen eval
    --codec cachegen:NAME`` takes them too)."""
    L = spec.identity().num_layers
    theta = rope_thetas(spec.config)

    def uniform(bins: int, key_scale: str, value_scale: str, hadamard: bool) -> QuantConfig:
        return QuantConfig((bins,) * L, (bins,) * L, key_scale, value_scale, hadamard)

    def ablation(name: str, config: QuantConfig) -> dict[str, QuantConfig]:
        """``config`` alone, with the first token exact, with keys turned back by their
        rotary angles, and with both (models without RoPE: the first two only)."""
        out = {name: config, f"{name}+sink": replace(config, exact_tokens=1)}
        if any(theta):
            out[f"{name}+rope"] = replace(config, rope_theta=theta)
            out[f"{name}+rope+sink"] = replace(config, rope_theta=theta, exact_tokens=1)
        return out

    paper2 = paper_levels(L)[2]
    k16_v6 = QuantConfig((16,) * L, (6,) * L, "token", "token-head", hadamard=True)
    k32_v6 = QuantConfig((32,) * L, (6,) * L, "token", "token-head", hadamard=False)
    return {
        # the paper's level 2 with its token-wise locality (anchors + deltas) switched on
        "p2-locality": QuantConfig(paper2.key_bins, paper2.value_bins, group_size=10),
        # the best hand-made scheme before calibration (docs/codec.md, "Scales against bins"):
        # keys scaled per channel, values per token and head
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
    return Candidate(
        "cachegen", name, codec_roundtrip(codec, VARIANT_LEVEL), options=config.to_dict()
    )
