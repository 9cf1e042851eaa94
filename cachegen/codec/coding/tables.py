"""Probability tables of the cachegen codec, and where a decoder gets them.

CacheGen entropy-codes every (layer, K/V, segment, channel) with its own probability model.
Sending those tables with every chunk would cost more than the chunk, so, as the paper does
offline, they are calibrated once per model and shared by encoder and decoder.

:class:`LevelTables` holds the frequency tables of one quantization config. Its id is the
content hash of its file (``<id>.cgtab``), which records the model fingerprint and geometry,
what the tables were calibrated on, the packed config and the frequencies. A bitstream
carries the id and the packed config; the decoder asks :func:`find_tables` for them, which
looks in memory, then in each *table provider* in turn (a directory by default; others can
be added with :func:`add_provider`, e.g. a chunk store that holds the tables its chunks
need) and checks that the file's hash is its id. A provider may serve the transform codecs'
model files too (``cachegen.codec.transform.model_file``): one ``add_provider`` call makes
both travel.

Nothing here builds tables: that runs the model and lives above the codec
(``cachegen.profiles``). A missing table is a ``CodecError`` that says where to get it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import threading
from pathlib import Path
from typing import Protocol

import numpy as np

from cachegen.codec.cachegen.quant import QuantConfig, alphabet_size
from cachegen.codec.coding import rans
from cachegen.codec.errors import CodecError
from cachegen.constants import cache_root
from cachegen.fileio import write_atomic
from cachegen.kv import ModelIdentity

KINDS = ("k", "v")
MAGIC = b"CGTB"
FORMAT = "cachegen-codec-tables"
FORMAT_VERSION = 1
_MAX_META_JSON = 1 << 16
_CACHE_SIZE = 12


def profiles_dir() -> Path:
    """Where profiles and their tables live: ``$CACHEGEN_PROFILE_DIR``, else
    ``cachegen.constants.cache_root()/profiles``."""
    explicit = os.environ.get("CACHEGEN_PROFILE_DIR")
    return Path(explicit).expanduser() if explicit else cache_root() / "profiles"


def tables_dir() -> Path:
    return profiles_dir() / "tables"


def num_segments(config: QuantConfig) -> int:
    """Symbol segments per (layer, K/V): all tokens, or anchors and deltas with locality."""
    return 2 if config.group_size else 1


def alphabets(config: QuantConfig, model: ModelIdentity) -> np.ndarray:
    """Alphabet size of every table row."""
    C, S = model.num_kv_heads * model.head_dim, num_segments(config)
    per_stream = [
        alphabet_size(config.bins(kind)[layer])
        for layer in range(model.num_layers)
        for kind in KINDS
        for _ in range(S)
    ]
    return np.repeat(np.array(per_stream, dtype=np.int64), C)


class LevelTables:
    """Frequency tables of one quantization config: one row per (layer, K/V, segment, channel)."""

    def __init__(
        self, tables_id: str, config: QuantConfig, model: ModelIdentity, freq: np.ndarray
    ) -> None:
        self.id = tables_id
        self.config = config
        self.model = model
        self.freq = freq
        self.num_channels = model.num_kv_heads * model.head_dim
        self.num_segments = num_segments(config)

    def base(self, layer: int, kind: int, segment: int) -> int:
        """Row of channel 0 of a (layer, K/V index, segment) stream."""
        return ((layer * 2 + kind) * self.num_segments + segment) * self.num_channels

    @functools.cached_property
    def freq_cum(self) -> np.ndarray:
        return rans.pack_freq_cum(self.freq)

    @functools.cached_property
    def slots(self) -> np.ndarray:
        return rans.slot_table(self.freq)

    @functools.cached_property
    def cheapest_symbol_bits(self) -> np.ndarray:
        """Per row: the code length of its most probable symbol (decoders' size checks)."""
        return -np.log2(self.freq.max(axis=1).astype(np.float64) / rans.PROB_SCALE)

    @property
    def short_id(self) -> str:
        return self.id[:16]


# ---- the file format ------------------------------------------------------------------------


def _canonical(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def tables_file(
    model: ModelIdentity, config: QuantConfig, freq: np.ndarray, calibration: dict
) -> tuple[str, bytes]:
    """``(tables id, file bytes)`` for frequencies ``freq`` calibrated as ``calibration`` says."""
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model": {
            "fingerprint": model.fingerprint,
            "num_layers": model.num_layers,
            "num_kv_heads": model.num_kv_heads,
            "head_dim": model.head_dim,
        },
        "calibration": calibration,
        "config": config.pack().hex(),
        "prob_bits": rans.PROB_BITS,
        "num_tables": int(freq.shape[0]),
        "width": int(freq.shape[1]),
    }
    raw = _canonical(meta)
    data = MAGIC + struct.pack("<I", len(raw)) + raw + freq.astype("<u2").tobytes()
    return hashlib.sha256(data).hexdigest()[:32], data


def parse_tables(data: bytes, tables_id: str, where: str) -> LevelTables:
    """Validate a tables file fully (its hash must be its id) and read it."""
    if hashlib.sha256(data).hexdigest()[:32] != tables_id:
        raise CodecError(
            f"profile tables {where} are corrupt (content does not match the id {tables_id[:16]}); "
            "delete the file and copy or rebuild it"
        )
    try:
        if data[:4] != MAGIC:
            raise ValueError("bad magic")
        (meta_len,) = struct.unpack_from("<I", data, 4)
        if meta_len > _MAX_META_JSON:
            raise ValueError("metadata too large")
        meta = json.loads(data[8 : 8 + meta_len])
        if (
            meta.get("format") != FORMAT
            or meta.get("version") != FORMAT_VERSION
            or meta.get("prob_bits") != rans.PROB_BITS
        ):
            raise ValueError(
                f"unsupported tables format {meta.get('format')!r} version {meta.get('version')!r}"
            )
        m = meta["model"]
        model = ModelIdentity(
            "",
            str(m["fingerprint"]),
            int(m["num_layers"]),
            int(m["num_kv_heads"]),
            int(m["head_dim"]),
        )
        config = QuantConfig.unpack(bytes.fromhex(meta["config"]))
        n, width = int(meta["num_tables"]), int(meta["width"])
        freq = np.frombuffer(data, dtype="<u2", offset=8 + meta_len).astype(np.uint16)
        sizes = alphabets(config, model)
        if freq.size != n * width or sizes.size != n or width < sizes.max():
            raise ValueError("table size does not match the config")
        freq = freq.reshape(n, width)
        inside = np.arange(width)[None, :] < sizes[:, None]
        if (
            np.any(freq.sum(axis=1, dtype=np.int64) != rans.PROB_SCALE)
            or np.any((freq == 0) & inside)
            or np.any((freq != 0) & ~inside)
        ):
            raise ValueError("frequencies are not normalized")
    except (ValueError, KeyError, TypeError, struct.error, json.JSONDecodeError, CodecError) as exc:
        raise CodecError(
            f"profile tables {where} are unreadable ({exc}); delete the file and copy or rebuild it"
        ) from exc
    return LevelTables(tables_id, config, model, freq)


# ---- providers ------------------------------------------------------------------------------


class TablesRefused(CodecError):
    """A provider holds the tables asked for, but they fail its checks (checksum, signature,
    size): they are not used, and a decode that needs them fails with this reason. Nothing is
    wrong with the bitstreams that name them."""


class TablesMissing(CodecError):
    """No provider holds the tables a bitstream names: a decode that needs them fails with
    this message (what to copy, or what to run). The bitstream itself is sound."""


class TableProvider(Protocol):
    """Somewhere tables files can be read from, by id."""

    def read_tables(self, tables_id: str) -> bytes | None:
        """The file's bytes, or None if this provider does not hold it."""

    def describe(self) -> str:
        """Where this provider looks, for error messages."""


class DirectoryTables:
    """Tables files ``<id>.cgtab`` in a directory (default: :func:`tables_dir`, read when
    used, so ``CACHEGEN_PROFILE_DIR`` may change)."""

    def __init__(self, directory: Path | None = None) -> None:
        self._directory = directory

    @property
    def directory(self) -> Path:
        return self._directory if self._directory is not None else tables_dir()

    def path(self, tables_id: str) -> Path:
        return self.directory / f"{tables_id}.cgtab"

    def read_tables(self, tables_id: str) -> bytes | None:
        path = self.path(tables_id)
        return path.read_bytes() if path.is_file() else None

    def write_tables(self, tables_id: str, data: bytes) -> Path:
        path = self.path(tables_id)
        if not path.is_file():
            write_atomic(path, data)
        return path

    def describe(self) -> str:
        return str(self.directory)


LOCAL = DirectoryTables()
_providers: list[TableProvider] = [LOCAL]
_cache: dict[str, LevelTables] = {}
_lock = threading.Lock()


def add_provider(provider: TableProvider) -> None:
    """Look for tables in ``provider`` too (after the ones added before it), and model files
    when it serves them (``cachegen.codec.transform.model_file.ModelFileProvider``)."""
    with _lock:
        if provider not in _providers:
            _providers.append(provider)


def providers() -> list[TableProvider]:
    """The providers, in the order they are asked."""
    with _lock:
        return list(_providers)


def remove_provider(provider: TableProvider) -> None:
    with _lock:
        if provider in _providers and provider is not LOCAL:
            _providers.remove(provider)


def remember(tables: LevelTables) -> None:
    """Keep ``tables`` in memory (the most recently used few)."""
    with _lock:
        _cache.pop(tables.id, None)
        _cache[tables.id] = tables
        while len(_cache) > _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))


def forget_cached_tables() -> None:
    """Drop tables held in memory (they are read again on next use)."""
    with _lock:
        _cache.clear()


def save_tables(tables_id: str, data: bytes) -> LevelTables:
    """Validate a tables file, write it into the local directory and keep it in memory."""
    tables = parse_tables(data, tables_id, f"{tables_id[:16]} (new)")
    LOCAL.write_tables(tables_id, data)
    remember(tables)
    return tables


def find_tables(tables_id: str, config: QuantConfig, model: ModelIdentity) -> LevelTables:
    """The tables a bitstream names, from memory or from a provider.

    Raises ``CodecError`` that says how to get them when no provider holds them; never runs
    a model.
    """
    with _lock:
        tables = _cache.get(tables_id)
        providers = list(_providers)
    if tables is None:
        for provider in providers:
            data = provider.read_tables(tables_id)
            if data is not None:
                tables = parse_tables(data, tables_id, f"{tables_id[:16]} in {provider.describe()}")
                remember(tables)
                break
    if tables is None:
        where = ", ".join(p.describe() for p in providers)
        raise TablesMissing(
            f"profile tables {tables_id[:16]} for model {model.name!r} are not in {where}; copy "
            f"{tables_id}.cgtab from the encoding machine's profiles/tables directory into "
            f"{LOCAL.describe()}, or run `cachegen profile build --model {model.name}` where the "
            "model is available"
        )
    if tables.config != config or tables.model.fingerprint != model.fingerprint:
        raise CodecError(
            f"profile tables {tables_id[:16]} do not belong to this bitstream's model and level"
        )
    return tables
