"""Model-level codec profiles: quality levels and their calibrated probability tables.

CacheGen entropy-codes every (layer, K/V, channel) with its own probability model. Sending
those tables with every chunk would cost more than the chunk (about 0.7 MB for SmolLM2), so,
as the paper does offline, tables are calibrated once per model on a fixed text and shared
by encoder and decoder:

* :class:`LevelTables` holds the frequency tables of one quantization config. Its id is the
  content hash of its file, which records the model fingerprint and geometry, the
  calibration spec, the packed config and the frequencies. Bitstreams carry this id plus
  the packed config, so any machine with the model can rebuild the tables and check the
  hash; files live in ``profiles_dir()/tables/<id>.cgtab``.
* :class:`Profile` is what a model's encoder uses: quality levels (id -> config, with the
  paper's presets 1/2/3 scaled to depth), the default level, and the tables id of each
  level, stored in ``profiles_dir()/<fingerprint[:16]>/profile.json``. ``Profile.id`` is the
  hash of that content. Calibrated levels are added with :meth:`Profile.add_level`.

Calibration text: the ``CALIBRATION_TOPICS`` of ``pydoc_data.topics`` (the first six topic
names in sorted order), joined by blank lines, first ``CALIBRATION_TOKENS`` tokens, one
prefill, quantized in chunks of ``CALIBRATION_CHUNK`` tokens. Quality evaluation must skip
these topics. Building is deterministic as long as the model's forward pass is (same
weights, same torch CPU kernels); if a rebuilt table differs, decoding says so and how to
copy the file instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cachegen import models
from cachegen.codec import rans
from cachegen.codec.errors import CodecError
from cachegen.codec.quant import QuantConfig, alphabet_size, paper_levels, quantize_chunk
from cachegen.constants import CHUNK_TOKENS, cache_root
from cachegen.errors import CacheGenError
from cachegen.fileio import write_atomic
from cachegen.kv import KVCache, ModelIdentity

CALIBRATION_NUM_TOPICS = 6
CALIBRATION_TOKENS = 2048
CALIBRATION_CHUNK = CHUNK_TOKENS
DEFAULT_LEVEL = 2
KINDS = ("k", "v")

TABLES_MAGIC = b"CGTB"
TABLES_FORMAT = "cachegen-codec-tables"
PROFILE_FORMAT = "cachegen-codec-profile"
FORMAT_VERSION = 1
_MAX_TABLES_JSON = 1 << 16


def _calibration_topics() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    return tuple(sorted(topics)[:CALIBRATION_NUM_TOPICS])


CALIBRATION_TOPICS: tuple[str, ...] = _calibration_topics()


def calibration_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in CALIBRATION_TOPICS)


def calibration_spec() -> dict:
    """What the tables were calibrated on; part of every tables id."""
    return {
        "source": "pydoc_data.topics",
        "topics": list(CALIBRATION_TOPICS),
        "text_sha256": hashlib.sha256(calibration_text().encode()).hexdigest(),
        "max_tokens": CALIBRATION_TOKENS,
        "chunk_tokens": CALIBRATION_CHUNK,
    }


def profiles_dir() -> Path:
    """Where profiles live: ``$CACHEGEN_PROFILE_DIR``, else ``cachegen.constants.cache_root()/profiles``."""
    explicit = os.environ.get("CACHEGEN_PROFILE_DIR")
    return Path(explicit).expanduser() if explicit else cache_root() / "profiles"


def _canonical(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ---- tables ---------------------------------------------------------------------------------


def num_segments(config: QuantConfig) -> int:
    """Symbol segments per (layer, K/V): all tokens, or anchors and deltas with locality."""
    return 2 if config.group_size else 1


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


def _tables_meta(model: ModelIdentity, config: QuantConfig, freq: np.ndarray) -> dict:
    return {
        "format": TABLES_FORMAT,
        "version": FORMAT_VERSION,
        "model": {
            "fingerprint": model.fingerprint,
            "num_layers": model.num_layers,
            "num_kv_heads": model.num_kv_heads,
            "head_dim": model.head_dim,
        },
        "calibration": calibration_spec(),
        "config": config.pack().hex(),
        "prob_bits": rans.PROB_BITS,
        "num_tables": int(freq.shape[0]),
        "width": int(freq.shape[1]),
    }


def _tables_file(model: ModelIdentity, config: QuantConfig, freq: np.ndarray) -> bytes:
    meta = _canonical(_tables_meta(model, config, freq))
    return TABLES_MAGIC + struct.pack("<I", len(meta)) + meta + freq.astype("<u2").tobytes()


def tables_path(tables_id: str) -> Path:
    return profiles_dir() / "tables" / f"{tables_id}.cgtab"


def _alphabets(config: QuantConfig, model: ModelIdentity) -> np.ndarray:
    """Alphabet size of every table row."""
    C, S = model.num_kv_heads * model.head_dim, num_segments(config)
    per_stream = [
        alphabet_size(config.bins(kind)[layer])
        for layer in range(model.num_layers)
        for kind in KINDS
        for _ in range(S)
    ]
    return np.repeat(np.array(per_stream, dtype=np.int64), C)


def _count_symbols(kv: KVCache, config: QuantConfig) -> np.ndarray:
    """Symbol counts ``[tables, width]`` of the calibration KV quantized with ``config``."""
    L, H, D = kv.num_layers, kv.num_kv_heads, kv.head_dim
    C, S = H * D, num_segments(config)
    width = max(alphabet_size(b) for b in config.key_bins + config.value_bins)
    counts = torch.zeros(L * 2 * S * C * width, dtype=torch.int64)
    layer = torch.arange(L).view(L, 1, 1)
    channel = torch.arange(C).view(1, C, 1)
    for chunk in kv.chunks(CALIBRATION_CHUNK):
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
    freq = rans.quantize_frequencies(counts, _alphabets(config, model))
    data = _tables_file(model, config, freq)
    tables_id = hashlib.sha256(data).hexdigest()[:32]
    path = tables_path(tables_id)
    if not path.is_file():
        write_atomic(path, data)
    tables = LevelTables(tables_id, config, model, freq)
    _remember(tables)
    return tables


def load_tables_file(path: Path, tables_id: str) -> LevelTables:
    """Read and fully validate a tables file (its hash must be its id)."""
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest()[:32] != tables_id:
        raise CodecError(
            f"profile tables {path} are corrupt (content does not match the id); delete the file to rebuild it"
        )
    try:
        if data[:4] != TABLES_MAGIC:
            raise ValueError("bad magic")
        (meta_len,) = struct.unpack_from("<I", data, 4)
        if meta_len > _MAX_TABLES_JSON:
            raise ValueError("metadata too large")
        meta = json.loads(data[8 : 8 + meta_len])
        if (
            meta.get("format") != TABLES_FORMAT
            or meta.get("version") != FORMAT_VERSION
            or meta.get("prob_bits") != rans.PROB_BITS
        ):
            raise ValueError("unsupported tables format")
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
        alphabets = _alphabets(config, model)
        if freq.size != n * width or alphabets.size != n or width < alphabets.max():
            raise ValueError("table size does not match the config")
        freq = freq.reshape(n, width)
        inside = np.arange(width)[None, :] < alphabets[:, None]
        if (
            np.any(freq.sum(axis=1, dtype=np.int64) != rans.PROB_SCALE)
            or np.any((freq == 0) & inside)
            or np.any((freq != 0) & ~inside)
        ):
            raise ValueError("frequencies are not normalized")
    except (ValueError, KeyError, TypeError, struct.error, json.JSONDecodeError, CodecError) as exc:
        raise CodecError(
            f"profile tables {path} are unreadable ({exc}); delete the file to rebuild it"
        ) from exc
    return LevelTables(tables_id, config, model, freq)


_cache: dict[str, LevelTables] = {}
_cache_lock = threading.Lock()
_CACHE_SIZE = 12


def _remember(tables: LevelTables) -> None:
    with _cache_lock:
        _cache.pop(tables.id, None)
        _cache[tables.id] = tables
        while len(_cache) > _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))


def forget_cached_tables() -> None:
    """Drop tables held in memory (they are reloaded or rebuilt on next use)."""
    with _cache_lock:
        _cache.clear()


def find_tables(tables_id: str, config: QuantConfig, model: ModelIdentity) -> LevelTables:
    """Tables a bitstream names: from memory, from disk, or rebuilt from the model.

    Raises ``CodecError`` that says how to get them when none of these works.
    """
    with _cache_lock:
        tables = _cache.get(tables_id)
    path = tables_path(tables_id)
    if tables is None and path.is_file():
        tables = load_tables_file(path, tables_id)
        _remember(tables)
    if tables is not None:
        if tables.config != config or tables.model.fingerprint != model.fingerprint:
            raise CodecError(
                f"profile tables {tables_id[:16]} do not belong to this bitstream's model and level"
            )
        return tables
    how = (
        f"copy {path.name} from the encoding machine's {path.parent} into {path.parent}, or run "
        f"`cachegen profile build --model {model.name}` where the model is available"
    )
    try:
        spec = models.resolve(model.name)
        if spec.identity().fingerprint != model.fingerprint:
            raise CodecError(
                f"the local model {model.name!r} has different weights than the encoder's"
            )
        rebuilt = build_tables(spec, config)
    except CacheGenError as exc:
        raise CodecError(
            f"profile tables {tables_id[:16]} for model {model.name!r} are not in {path.parent} "
            f"and cannot be rebuilt here ({exc}); {how}"
        ) from exc
    if rebuilt.id != tables_id:
        raise CodecError(
            f"profile tables {tables_id[:16]} for model {model.name!r} were rebuilt here but came out different "
            f"({rebuilt.id[:16]}: the model's forward pass is not bit-identical on this machine); {how}"
        )
    return rebuilt


@functools.lru_cache(maxsize=2)
def _calibration_kv(name: str, fingerprint: str) -> KVCache:
    from cachegen.extract import extract_kv, load_model

    _, tokenizer, spec = load_model(name)
    ids = torch.tensor(
        tokenizer(calibration_text())["input_ids"][:CALIBRATION_TOKENS], dtype=torch.int64
    )
    ids = ids[: spec.max_positions]
    return extract_kv(spec, token_ids=ids)


def calibration_kv(spec: models.ModelSpec) -> KVCache:
    """KV of the calibration text (cached per process)."""
    return _calibration_kv(spec.name, spec.identity().fingerprint)


# ---- profiles -------------------------------------------------------------------------------


@dataclass
class Profile:
    """A model's quality levels (id -> config), their tables ids and the default level."""

    model: ModelIdentity
    levels: dict[int, QuantConfig]
    tables_ids: dict[int, str]
    default_level: int
    spec: models.ModelSpec

    @property
    def id(self) -> str:
        """Content hash of the profile (levels, tables ids, default, calibration)."""
        return hashlib.sha256(_canonical(self._content())).hexdigest()[:16]

    @property
    def path(self) -> Path:
        return profile_path(self.model)

    def calibrated_levels(self) -> list[int]:
        """The levels that are the model's shipped calibration, unchanged: ``cachegen
        calibrate``'s choices for measured perplexity targets (docs/quality.md). Empty for a
        model without one."""
        shipped, _ = shipped_levels(self.model)
        return sorted(
            level for level, config in shipped.items() if self.levels.get(level) == config
        )

    def config(self, level: int) -> QuantConfig:
        if level not in self.levels:
            raise CodecError(
                f"level {level} is not defined for {self.model.name}; levels are {sorted(self.levels)}"
            )
        return self.levels[level]

    def tables(self, level: int) -> LevelTables:
        return find_tables(self.tables_ids[level], self.config(level), self.model)

    def add_level(
        self, level: int, config: QuantConfig, *, make_default: bool = False
    ) -> LevelTables:
        """Calibrate tables for ``config``, store it as ``level`` (replacing any) and persist."""
        if not 0 <= int(level) <= 0xFFFF:
            raise CodecError(f"level ids are 0..65535, got {level}")
        tables = build_tables(self.spec, config)
        with _locked(self.path.parent):
            self._reload()
            self.levels[int(level)] = config
            self.tables_ids[int(level)] = tables.id
            if make_default:
                self.default_level = int(level)
            self._save()
        return tables

    def set_default_level(self, level: int) -> None:
        with _locked(self.path.parent):
            self._reload()
            self.config(level)
            self.default_level = int(level)
            self._save()

    def remove_level(self, level: int) -> None:
        with _locked(self.path.parent):
            self._reload()
            self.config(level)
            if level == self.default_level:
                raise CodecError(f"level {level} is the default; set another default first")
            del self.levels[level], self.tables_ids[level]
            self._save()

    def to_dict(self) -> dict:
        return {"id": self.id, "path": str(self.path), **self._content()}

    def _content(self) -> dict:
        return {
            "format": PROFILE_FORMAT,
            "version": FORMAT_VERSION,
            "model": self.model.to_dict(),
            "calibration": calibration_spec(),
            "default_level": self.default_level,
            "levels": {
                str(k): {"config": self.levels[k].to_dict(), "tables": self.tables_ids[k]}
                for k in sorted(self.levels)
            },
        }

    def _save(self) -> None:
        write_atomic(
            self.path, json.dumps(self._content(), indent=1, sort_keys=True).encode() + b"\n"
        )

    def _reload(self) -> None:
        """Pick up levels another process added since this profile was loaded."""
        fresh = _read_profile(self.path, self.spec)
        if fresh is not None:
            self.levels, self.tables_ids, self.default_level = (
                fresh.levels,
                fresh.tables_ids,
                fresh.default_level,
            )


def profile_path(model: ModelIdentity) -> Path:
    return profiles_dir() / model.fingerprint[:16] / "profile.json"


def _read_profile(path: Path, spec: models.ModelSpec) -> Profile | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != PROFILE_FORMAT or data.get("version") != FORMAT_VERSION:
            raise ValueError("unsupported profile format")
        if data.get("calibration") != calibration_spec():
            return None  # calibrated on other text (another Python version): rebuild
        levels = {int(k): QuantConfig.from_dict(v["config"]) for k, v in data["levels"].items()}
        tables_ids = {int(k): str(v["tables"]) for k, v in data["levels"].items()}
        default = int(data["default_level"])
        if default not in levels:
            raise ValueError("default level is not defined")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CodecError) as exc:
        raise CodecError(
            f"codec profile {path} is unreadable ({exc}); delete it to rebuild the presets"
        ) from exc
    return Profile(spec.identity(), levels, tables_ids, default, spec)


SHIPPED_DIR = Path(__file__).parent / "calibrated"


def shipped_levels(model: ModelIdentity) -> tuple[dict[int, QuantConfig], int | None]:
    """Levels that ``cachegen calibrate`` chose for ``model`` and that ship with the package
    (``cachegen/codec/calibrated/*.json``, matched by weights fingerprint), and their default.

    They let a fresh install use the calibrated default without running the calibration.
    """
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        if data["model"]["fingerprint"] == model.fingerprint:
            levels = {int(k): QuantConfig.from_dict(v["config"]) for k, v in data["levels"].items()}
            return levels, int(data["default_level"])
    return {}, None


def load_profile(model: str | models.ModelSpec, *, build: bool = True) -> Profile:
    """The profile of ``model``, built on first use with the paper presets and any shipped
    calibrated levels (building runs the model once over the calibration text; docs/codec.md,
    "Profiles and quality levels")."""
    spec = models.resolve(model) if isinstance(model, str) else model
    identity = spec.identity()
    path = profile_path(identity)
    existing = _read_profile(path, spec)
    if existing is not None or not build:
        if existing is None:
            raise CodecError(
                f"no codec profile for {spec.name} in {path.parent}; run `cachegen profile build --model {spec.name}`"
            )
        return existing
    with _locked(path.parent):
        existing = _read_profile(path, spec)
        if existing is not None:
            return existing
        levels = paper_levels(identity.num_layers)
        calibrated, default = shipped_levels(identity)
        levels.update(calibrated)
        tables_ids = {level: build_tables(spec, config).id for level, config in levels.items()}
        profile = Profile(identity, levels, tables_ids, default or DEFAULT_LEVEL, spec)
        profile._save()
        return profile
