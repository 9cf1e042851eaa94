"""Codecs as evaluation candidates: encode with the real codec, decode the real bitstream.

The bits a candidate reports are ``inspect(blob)["bits_per_element"]`` times the number of
elements, i.e. everything in the bitstream (payload, tables, scales, headers) is counted.
"""

from __future__ import annotations

from cachegen.errors import InputError
from cachegen.kv import KVCache
from cachegen.models import ModelSpec
from cachegen.quality.evaluate import Candidate


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
    from cachegen.codec import Profile, get_codec
    from cachegen.codec.profile import build_tables

    tables = build_tables(spec, config)
    profile = Profile(spec.identity(), {level: config}, {level: tables.id}, level, spec)
    return get_codec("cachegen", profile=profile)


def codec_candidates(spec: ModelSpec, name: str, levels: list[str] | None) -> list[Candidate]:
    """One candidate per requested level of codec ``name`` (``None``: all its levels); for
    cachegen a level may also name one of the sweep's variants."""
    from cachegen.codec import get_codec
    from cachegen.quality.sweep import variant_candidate, variants

    codec = get_codec(name, model=spec)
    available = {str(level): level for level in codec.levels}
    named = variants(spec) if name == "cachegen" else {}
    wanted = list(available) if levels is None else levels
    unknown = [level for level in wanted if level not in available and level not in named]
    if unknown:
        extra = f"; or one of the variants {', '.join(named)}" if named else ""
        raise InputError(
            f"codec {name} has no level {', '.join(unknown)}; its levels are {', '.join(available) or '(none)'}{extra}"
        )
    return [
        Candidate(name, level, codec_roundtrip(codec, available[level])) if level in available
        else variant_candidate(spec, level, named[level])
        for level in wanted
    ]


def parse_codec_args(codecs: list[str], levels: str | None) -> list[tuple[str, list[str] | None]]:
    """``--codec NAME[:L1,L2]`` (repeatable) plus ``--levels`` for those without their own."""
    default = None if levels in (None, "all") else [x.strip() for x in levels.split(",") if x.strip()]
    out = []
    for item in codecs:
        name, _, own = item.partition(":")
        if not name:
            raise InputError(f"--codec {item!r} names no codec")
        out.append((name, [x.strip() for x in own.split(",") if x.strip()] if own else default))
    return out
