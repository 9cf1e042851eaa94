"""Building codec profiles: the one place that runs a model to make probability tables.

The codec (``cachegen.codec``) only reads profiles and tables. Building them needs the
model's KV of the calibration text, so it lives here, above both the codec and extraction:

* :func:`calibration_spec` / :func:`calibration_kv`: what tables are calibrated on (the
  workload's ``tables`` split, first ``CALIBRATION_TOKENS`` tokens, one prefill, quantized
  in chunks of ``CHUNK_TOKENS``) and its KV.
* :func:`build_tables`: tables for one quantization config, written to the local tables
  directory (their id is their content hash, so building twice writes nothing new).
* :func:`ensure_profile`: the model's profile, built on first use with the paper presets
  and any shipped calibrated levels; rebuilt when it was calibrated on other text; missing
  tables of an existing profile are rebuilt and must come out identical.
* :func:`add_level`: a calibrated level into the profile (``cachegen calibrate``).
* :func:`codec_for`: any codec with what it reads built first (the transform codecs' model
  files are fitted by :mod:`cachegen.fitting`).

Building is deterministic as long as the model's forward pass is (same weights, same torch
CPU kernels); if a rebuilt table differs, the error says so and how to copy the file.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from cachegen import models, workload
from cachegen.codec.cachegen.profile import (
    DEFAULT_LEVEL,
    Profile,
    locked,
    profile_path,
    read_profile,
    shipped_levels,
)
from cachegen.codec.cachegen.quant import QuantConfig, alphabet_size, paper_levels, quantize_chunk
from cachegen.codec.coding import rans
from cachegen.codec.coding.tables import (
    KINDS,
    LOCAL,
    LevelTables,
    TablesRefused,
    alphabets,
    num_segments,
    save_tables,
    tables_file,
)
from cachegen.codec.errors import CodecError
from cachegen.constants import CHUNK_TOKENS
from cachegen.fitting.kvtc import ensure_kvtc_basis
from cachegen.fitting.tcq import ensure_tcq_model
from cachegen.kv import KVCache
from cachegen.modes import FORMS

CALIBRATION_TOKENS = 2048
# The model runs in float32 for the tables' calibration KV, which is then rounded to bf16 as
# served KV is: every CPU kind rounds bf16 arithmetic differently, and without bf16
# instructions bf16 is several times slower than float32.
CALIBRATION_MODEL_DTYPE = torch.float32


def calibration_spec() -> dict:
    """What tables are calibrated on; part of every tables id and profile."""
    return {
        "source": "pydoc_data.topics",
        "topics": workload.topics("tables"),
        "text_sha256": hashlib.sha256(workload.text("tables").encode()).hexdigest(),
        "max_tokens": CALIBRATION_TOKENS,
        "chunk_tokens": CHUNK_TOKENS,
        "model_dtype": str(CALIBRATION_MODEL_DTYPE).removeprefix("torch."),
    }


@functools.lru_cache(maxsize=2)
def _calibration_kv(name: str, fingerprint: str) -> KVCache:
    from cachegen.extract import extract_kv, load_model

    _, tokenizer, spec = load_model(name)
    ids = tokenizer(workload.text("tables"))["input_ids"][:CALIBRATION_TOKENS]
    ids = torch.tensor(ids, dtype=torch.int64)[: spec.max_positions]
    return extract_kv(spec, token_ids=ids, dtype=CALIBRATION_MODEL_DTYPE).to(torch.bfloat16)


def calibration_kv(spec: models.ModelSpec) -> KVCache:
    """KV of the calibration text (cached per process)."""
    return _calibration_kv(spec.name, spec.identity().fingerprint)


def _count_symbols(kv: KVCache, config: QuantConfig) -> np.ndarray:
    """Symbol counts ``[tables, width]`` of the calibration KV quantized with ``config``."""
    L, H, D = kv.num_layers, kv.num_kv_heads, kv.head_dim
    C, S = H * D, num_segments(config)
    width = max(alphabet_size(b) for b in config.key_bins + config.value_bins)
    counts = torch.zeros(L * 2 * S * C * width, dtype=torch.int64)
    layer = torch.arange(L).view(L, 1, 1)
    channel = torch.arange(C).view(1, C, 1)
    for chunk in kv.chunks(CHUNK_TOKENS):
        for k, kind in enumerate(KINDS):
            x = chunk.keys if kind == "k" else chunk.values
            for s, seg in enumerate(quantize_chunk(x, config, kind, chunk.start)):
                sym = seg.symbols.permute(0, 1, 3, 2).reshape(L, C, -1).to(torch.int64)
                row = ((layer * 2 + k) * S + s) * C + channel
                counts += torch.bincount((row * width + sym).reshape(-1), minlength=counts.numel())
    return counts.view(-1, width).numpy()


def build_tables(spec: models.ModelSpec, config: QuantConfig) -> LevelTables:
    """Calibrate tables for ``config`` on ``spec``'s calibration KV and store them."""
    model = spec.identity()
    config.check_geometry(model.num_layers, model.head_dim)
    counts = _count_symbols(calibration_kv(spec), config)
    freq = rans.quantize_frequencies(counts, alphabets(config, model))
    tables_id, data = tables_file(model, config, freq, calibration_spec())
    return save_tables(tables_id, data)


def ensure_profile(model: str | models.ModelSpec) -> Profile:
    """The profile of ``model``, built or repaired from the model where needed (building
    runs the model once: seconds for tiny models, tens of seconds for SmolLM2 on 2 cores)."""
    spec = models.resolve(model) if isinstance(model, str) else model
    identity = spec.identity()
    with locked(profile_path(identity).parent):
        profile = read_profile(identity)
        if profile is None or profile.calibration != calibration_spec():
            levels = paper_levels(identity.num_layers)
            calibrated, default = shipped_levels(identity)
            levels.update(calibrated)
            tables_ids = {level: build_tables(spec, config).id for level, config in levels.items()}
            profile = Profile(
                identity, levels, tables_ids, default or DEFAULT_LEVEL, calibration_spec()
            )
            profile.save()
            return profile
        _add_new_shipped_levels(spec, profile)
    for level in sorted(profile.levels):
        _ensure_tables(spec, profile, level)
    return profile


def _add_new_shipped_levels(spec: models.ModelSpec, profile: Profile) -> None:
    """Add to a profile built by an older release the shipped calibrated levels it lacks, and
    take the shipped default when it is one of them (a default the user set is kept: it names
    a level the profile has). Levels the profile has keep their configuration."""
    calibrated, default = shipped_levels(profile.model)
    added = {level: config for level, config in calibrated.items() if level not in profile.levels}
    for level, config in sorted(added.items()):
        profile.levels[level] = config
        profile.tables_ids[level] = build_tables(spec, config).id
    if default in added:
        profile.default_level = default
    if added:
        profile.save()


def _ensure_tables(spec: models.ModelSpec, profile: Profile, level: int) -> None:
    tables_id = profile.tables_ids[level]
    try:
        profile.tables(level)  # from the local directory or a provider (a chunk store)
        return
    except CodecError as exc:
        if LOCAL.path(tables_id).is_file():
            raise  # present but corrupt or foreign: say so rather than overwrite
        refused = f" ({exc})" if isinstance(exc, TablesRefused) else ""
    rebuilt = build_tables(spec, profile.config(level))
    if rebuilt.id != tables_id:
        raise CodecError(
            f"profile tables {tables_id[:16]} of {spec.name} level {level} were rebuilt here but "
            f"came out different ({rebuilt.id[:16]}: the model's forward pass is not bit-identical "
            f"on this machine); copy {tables_id}.cgtab from the machine that built the profile "
            f"into {LOCAL.describe()}{refused}"
        )


def add_level(
    model: str | models.ModelSpec, level: int, config: QuantConfig, *, make_default: bool = False
) -> Profile:
    """Calibrate tables for ``config`` and store it as ``level`` of the model's profile."""
    spec = models.resolve(model) if isinstance(model, str) else model
    profile = ensure_profile(spec)
    tables = build_tables(spec, config)
    profile.put_level(level, config, tables.id, make_default=make_default)
    return profile


def transient_profile(spec: models.ModelSpec, levels: dict[int, QuantConfig]) -> Profile:
    """A profile with only ``levels``, kept in memory (its tables are built and stored like
    any level's, by content id); the model's saved profile is not touched."""
    default = min(levels)
    ids = {level: build_tables(spec, config).id for level, config in levels.items()}
    return Profile(spec.identity(), dict(levels), ids, default, calibration_spec())


def compile_kernels(model: str | models.ModelSpec, profile: Profile) -> None:
    """Run the cachegen codec's numba kernels once at ``profile``'s default level, both forms,
    decoded into bf16 and float32, so that their compiled code is in numba's cache (beside the
    package) before a server's first request needs it: compiling them takes minutes on a
    2-core CPU."""
    from cachegen.codec import decode, get_codec
    from cachegen.extract import extract_kv, load_model

    _, tokenizer, spec = load_model(model)
    ids = tokenizer(workload.text("tables")[: 24 * CHUNK_TOKENS])["input_ids"][: 2 * CHUNK_TOKENS]
    kv = extract_kv(spec, token_ids=torch.tensor(ids, dtype=torch.int64))
    codec = get_codec("cachegen", profile=profile)
    for form in FORMS:
        blob = codec.encode(kv, profile.default_level, form=form)
        for dtype in (torch.bfloat16, torch.float32):
            decode(blob, out_dtype=dtype)


def codec_for(name: str, model: str | models.ModelSpec, build: bool = True, **options):
    """Codec ``name`` for ``model``, the model's profile (``kvtc``: its basis; ``tcq``: its
    model file) built first if it needs one (``cachegen.codec.get_codec`` only loads them).
    ``build=False`` (a server) never runs the model: a missing profile or model file raises
    ``CodecError`` naming the command that makes it."""
    from cachegen.codec import get_codec, load_profile

    if name == "kvtc":
        return get_codec(name, basis=ensure_kvtc_basis(model), **options)
    if name == "tcq":
        return get_codec(name, tcq=ensure_tcq_model(model, fit=build), **options)
    if name != "cachegen":
        return get_codec(name, **options)
    profile = ensure_profile(model) if build else load_profile(model)
    return get_codec(name, profile=profile, **options)
