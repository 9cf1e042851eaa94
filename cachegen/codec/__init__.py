"""KV-cache codecs: CacheGen (SIGCOMM 2024) and baselines, in one versioned bitstream.

    from cachegen.codec import get_codec, decode, inspect
    codec = get_codec("cachegen", model="smollm2-135m")
    blob = codec.encode(kv, level=2)        # self-contained bytes (header + frames)
    kv2 = decode(blob)                      # any codec; CodecError on bad input
    info = inspect(blob)                    # sizes, bits/element, ratios, per-layer breakdown

Quality levels of the cachegen codec live in the model's :class:`Profile`
(``load_profile(model)``), built once from the model by ``cachegen.profiles.ensure_profile``
(or ``cachegen profile build``); decoding needs only the probability tables a bitstream
names, from a :class:`TableProvider` (the local tables directory by default; one that serves
model files too, such as ``cachegen.store.tables.StoreTables``, also provides the tcq and kvtc
model files a bitstream names), and never runs a model. See docs/codec.md and docs/bitstream.md.
"""

from cachegen.codec.api import available_codecs, decode, form_of, get_codec, inspect
from cachegen.codec.base import Codec
from cachegen.codec.cachegen.profile import Profile, load_profile
from cachegen.codec.cachegen.quant import SCALE_KINDS, QuantConfig, paper_levels
from cachegen.codec.coding.tables import LevelTables, TableProvider, add_provider, profiles_dir
from cachegen.codec.errors import CodecError
from cachegen.codec.transform.model_file import ModelFileProvider, ModelFileRefused

__all__ = [
    "SCALE_KINDS",
    "Codec",
    "CodecError",
    "LevelTables",
    "ModelFileProvider",
    "ModelFileRefused",
    "Profile",
    "QuantConfig",
    "TableProvider",
    "add_provider",
    "available_codecs",
    "decode",
    "get_codec",
    "form_of",
    "inspect",
    "load_profile",
    "paper_levels",
    "profiles_dir",
]
