"""KV-cache codecs: CacheGen (SIGCOMM 2024) and baselines, in one versioned bitstream.

    from cachegen.codec import get_codec, decode, inspect
    codec = get_codec("cachegen", model="smollm2-135m")
    blob = codec.encode(kv, level=2)        # self-contained bytes (header + frames)
    kv2 = decode(blob)                      # any codec; CodecError on bad input
    info = inspect(blob)                    # sizes, bits/element, ratios, per-layer breakdown

Quality levels of the cachegen codec live in the model's :class:`Profile`
(``load_profile(model)``); ``Profile.add_level(level, QuantConfig(...))`` adds calibrated
ones. See docs/codec.md and docs/bitstream.md.
"""

from cachegen.codec.api import available_codecs, decode, get_codec, inspect
from cachegen.codec.base import Codec
from cachegen.codec.errors import CodecError
from cachegen.codec.profile import (
    CALIBRATION_TOPICS,
    LevelTables,
    Profile,
    calibration_text,
    load_profile,
    profiles_dir,
)
from cachegen.codec.quant import SCALE_KINDS, QuantConfig, paper_levels

PROFILE_TOPICS = CALIBRATION_TOPICS

__all__ = [
    "CALIBRATION_TOPICS",
    "PROFILE_TOPICS",
    "SCALE_KINDS",
    "Codec",
    "CodecError",
    "LevelTables",
    "Profile",
    "QuantConfig",
    "available_codecs",
    "calibration_text",
    "decode",
    "get_codec",
    "inspect",
    "load_profile",
    "paper_levels",
    "profiles_dir",
]
