"""The codec registry and the functions that work on any bitstream: decode and inspect.

The core codecs are built in. Other codecs (the lab's research codecs) are registered with
:func:`register_codec`, found through the ``cachegen.codecs`` entry points the first time a
codec name or a bitstream's codec id is not a core one.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from inspect import signature

import numpy as np
import torch

from cachegen import models
from cachegen.codec.base import Codec
from cachegen.codec.baselines import Fp8Codec, Int8Codec, Int8Decoder, RawCodec
from cachegen.codec.cachegen.codec import CacheGenCodec
from cachegen.codec.coding.bitstream import Header, parse_frames, parse_header
from cachegen.codec.errors import CodecError
from cachegen.codec.tcq.codec import TcqCodec
from cachegen.kv import KVCache
from cachegen.modes import LEVELED, Form

ENTRY_POINT_GROUP = "cachegen.codecs"
# codec ids of the codecs outside the core, so that their old streams keep their id and a
# stream of one that is not loaded names it
RESERVED_IDS = {
    4: "int8-zstd",
    5: "kivi2",
    10: "kvtc",
    11: "turboquant",
    20: "lmcache-cachegen",
    21: "lmcache-fp8",
    22: "lmcache-asym-k16-v8",
}
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_CODECS: dict[str, type[Codec]] = {
    cls.name: cls for cls in (RawCodec, Int8Codec, Fp8Codec, CacheGenCodec, TcqCodec)
}
_CODECS_BY_ID: dict[int, type[Codec]] = {cls.codec_id: cls for cls in _CODECS.values()}
_plugin_errors: dict[str, str] = {}  # entry point name -> why it did not load
_plugins_loaded = False


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Make ``cls`` selectable by its name and decodable by its codec id (again: no-op)."""
    for known, what in ((_CODECS.get(cls.name), "name"), (_CODECS_BY_ID.get(cls.codec_id), "id")):
        if known is not None and known is not cls:
            raise CodecError(f"codec {what} of {cls.__name__} is taken by {known.__name__}")
    reserved = RESERVED_IDS.get(cls.codec_id, cls.name)
    if reserved != cls.name:
        raise CodecError(f"codec id {cls.codec_id} is reserved for the {reserved} codec")
    _CODECS[cls.name] = cls
    _CODECS_BY_ID[cls.codec_id] = cls
    return cls


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            register_codec(entry.load())
        except Exception as exc:  # a broken plugin must leave the other codecs usable
            _plugin_errors[entry.name] = f"{type(exc).__name__}: {exc}"


def _not_loaded(name: str) -> str:
    """Why codec ``name`` (a registered plugin's or a reserved one) is missing, and the fix."""
    if name in _plugin_errors:
        return f"the {name} codec did not load ({_plugin_errors[name]})"
    return (
        f"the {name} codec is not registered: it comes from cachegen_lab.codecs through the "
        f"{ENTRY_POINT_GROUP!r} entry points, so reinstall cachegen (`pip install -e .` in a "
        "checkout) or pass its class to cachegen.codec.api.register_codec"
    )


def available_codecs() -> list[str]:
    """Every codec's name, in codec id order."""
    _load_plugins()
    return [cls.name for cls in sorted(_CODECS.values(), key=lambda cls: cls.codec_id)]


def _codec_named(name: str) -> type[Codec]:
    if name not in _CODECS:
        _load_plugins()
    cls = _CODECS.get(name)
    if cls is not None:
        return cls
    if name in _plugin_errors or name in RESERVED_IDS.values():
        raise CodecError(_not_loaded(name))
    raise CodecError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}")


def get_codec(name: str, model: models.ModelSpec | str | None = None, **options) -> Codec:
    """A codec by name. Codecs whose constructor takes ``model`` (``cachegen``, ``kvtc``,
    ``tcq``) need it (or bind to the KV's model on first encode) for their profile, basis or
    model file; the others ignore it. ``options`` go to the codec's constructor
    (``chunk_tokens`` for all; ``zstd_level`` for int8-zstd; ``group_size`` for kivi2)."""
    cls = _codec_named(name)
    if "model" in signature(cls).parameters:
        options["model"] = model
    try:
        return cls(**options)
    except TypeError as exc:
        raise CodecError(f"bad option for codec {name}: {exc}") from exc


def _codec_of(header: Header) -> type[Codec]:
    if header.codec_id not in _CODECS_BY_ID:
        _load_plugins()
    cls = _CODECS_BY_ID.get(header.codec_id)
    if cls is not None:
        return cls
    name = RESERVED_IDS.get(header.codec_id)
    if name is not None:
        raise CodecError(f"bitstream uses codec id {header.codec_id}: {_not_loaded(name)}")
    raise CodecError(
        f"bitstream uses codec id {header.codec_id}, which this cachegen does not know"
    )


def _open(blob: bytes | bytearray | memoryview, expect: Callable[[Header], None] | None = None):
    header = parse_header(blob)
    if expect is not None:  # before anything is sized from the header
        expect(header)
    cls = _codec_of(header)
    if header.form not in cls.forms:
        raise CodecError(f"bitstream header is corrupt (packed symbols in a {cls.name} stream)")
    frames = parse_frames(blob, header)
    decoder = cls.decoder(header)
    for frame in frames:
        decoder.check(frame)
    return header, cls, frames, decoder


def decode(
    blob: bytes | bytearray | memoryview,
    out_dtype: torch.dtype = torch.bfloat16,
    expect: Callable[[Header], None] | None = None,
) -> KVCache:
    """Decode a bitstream of any codec. Raises ``CodecError`` for corrupt or unsupported input.

    A stream of a layer subset decodes to a ``KVCache`` of the same layers (``layers``).
    ``expect(header)`` runs on the parsed header before its frames are read and before any
    output is allocated: a caller that knows what the stream must hold (a load knows the chunk
    it planned and the model's geometry) raises there, so a forged header never sizes an
    allocation."""
    if out_dtype not in OUT_DTYPES:
        raise CodecError(f"out_dtype must be one of {', '.join(str(d) for d in OUT_DTYPES)}")
    header, _, frames, decoder = _open(blob, expect)
    out = decoder.decode(frames, out_dtype)
    ids = np.concatenate([f.token_ids for f in frames]) if frames else np.zeros(0, dtype=np.int64)
    return KVCache(
        keys=out[0],
        values=out[1],
        token_ids=torch.from_numpy(ids),
        model=header.model,
        start=header.start,
        layers=header.layers,
    )


def int8_size(header: Header) -> int:
    """Bytes the ``int8`` codec would produce for the same KV and chunking."""
    dec = Int8Decoder(header)
    frames = sum(
        8 + header.frame_tokens(i) * header.token_width + dec.body_size(header.frame_tokens(i))
        for i in range(header.num_frames)
    )
    return header.size - len(header.params) + frames


def form_of(blob: bytes | bytearray | memoryview) -> Form:
    """The form (codec, level, packing) a bitstream was written in, from its header alone
    (the start of a stream is enough)."""
    header = parse_header(blob)
    cls = _codec_of(header)
    if cls.name not in LEVELED:
        return Form(cls.name)
    return Form(cls.name, header.level, header.form)


def inspect(blob: bytes | bytearray | memoryview) -> dict:
    """What a bitstream holds and what it costs, without decoding it.

    ``form`` is how a cachegen level's symbols are stored: "coded" (entropy-coded) or
    "packed" (bit-packed at a fixed width); the baselines are "coded".

    ``bits_per_element`` counts every byte (header, frame headers, token ids, scales,
    payload; a cachegen profile's tables are shared per model and reported separately).
    ``ratio_vs_fp16`` compares with 2 bytes per element, ``ratio_vs_int8`` with what the
    ``int8`` codec (per-token scale) produces for the same tokens and chunking. For a stream
    of a layer subset, ``num_layers`` counts the layers present, ``layer_subset`` lists them
    (None: all of the model's) and ``layers`` has one row per layer present, each naming its
    absolute index; ``model`` is the whole model's identity.
    """
    header, cls, frames, decoder = _open(blob)
    total = len(blob)
    elements = header.num_elements
    layer = np.zeros((header.num_layers, 2), dtype=np.float64)
    for frame in frames:
        layer += decoder.layer_bytes(frame)
    per_layer_elements = elements / header.num_layers if header.num_layers else 0
    bpe = total * 8 / elements if elements else None
    info = {
        "codec": cls.name,
        "level": header.level,
        "form": header.form,
        "format_version": header.version,
        "model": header.model.to_dict(),
        "num_layers": header.num_layers,
        "layer_subset": None if header.layers is None else list(header.layers),
        "num_kv_heads": header.num_kv_heads,
        "head_dim": header.head_dim,
        "start": header.start,
        "num_tokens": header.num_tokens,
        "chunk_tokens": header.chunk_tokens,
        "num_frames": header.num_frames,
        "source_dtype": str(header.dtype).removeprefix("torch."),
        "bytes": total,
        "header_bytes": header.size,
        "frame_header_bytes": 8 * len(frames),
        "token_id_bytes": header.num_tokens * header.token_width,
        "bits_per_element": bpe,
        "ratio_vs_fp16": (elements * 2 / total) if elements else None,
        "ratio_vs_int8": (int8_size(header) / total) if elements else None,
        "layers": [
            {
                "layer": index,
                "key_bytes": float(layer[i, 0]),
                "value_bytes": float(layer[i, 1]),
                "bits_per_element": float(layer[i].sum() * 8 / per_layer_elements)
                if elements
                else None,
            }
            for i, index in enumerate(header.layer_indices)
        ],
    }
    info.update(decoder.inspect_extras())
    return info
