"""Model files: what a transform codec fits once per model (a kvtc basis, a tcq model) and
reads back on every machine that decodes.

A model file is ``magic``, a u32 length, a canonical JSON header (schema, version, model
identity, calibration, array shapes, SHA-256 of the payload), then the payload: raw
little-endian arrays (no pickle). Its id is the SHA-256 of the whole file; reading checks both
hashes and every shape against the model's geometry, and any defect is a ``CodecError``.
Files live in the transforms directory as ``<id><suffix>`` (:class:`ModelFiles`); a model's
current one of a kind is named by its reference next to its cachegen profile
(:class:`ModelFileRef`).

A kind may also ship files with the package, named alike (:class:`ModelFiles`'s ``shipped``
directory): one not in the transforms directory is read from there, checked like a local one.
A file in neither is asked of the table providers
(``cachegen.codec.coding.tables.add_provider``) that serve model files too
(:class:`ModelFileProvider`, e.g. a chunk store: ``cachegen.store.tables.StoreTables``), so
that it travels with the chunks as their tables do. What a provider returns is checked like a
local file (its id, its own checks) and against the bitstream's model before it is used, then
kept in the transforms directory; a file that fails is refused (:class:`ModelFileRefused`).

:func:`same_model` is the one test of whether something fitted for one model serves another
(the same weights and KV geometry).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import struct
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from cachegen import models
from cachegen.codec.cachegen.profile import profile_path
from cachegen.codec.coding.tables import TablesMissing, TablesRefused, profiles_dir, providers
from cachegen.codec.errors import CodecError
from cachegen.errors import CacheGenError
from cachegen.fileio import check_version, versioned, write_atomic
from cachegen.kv import KVError, ModelIdentity

_MAX_HEADER_JSON = 1 << 20


def same_model(mine: ModelIdentity, theirs: ModelIdentity) -> bool:
    """Whether what was fitted for ``mine`` serves ``theirs``: the same weights fingerprint
    and KV geometry (names may differ)."""
    return (mine.fingerprint, mine.num_layers, mine.num_kv_heads, mine.head_dim) == (
        theirs.fingerprint,
        theirs.num_layers,
        theirs.num_kv_heads,
        theirs.head_dim,
    )


class ModelFile:
    """What every model file kind shares: its content id, size, levels and model check.

    A subclass has ``model``, ``calibration``, ``rope_thetas``, ``levels`` (level id -> its
    parameters, in increasing order) and ``file_bytes``; ``kind`` names it in messages,
    ``fitter`` says what fits one."""

    kind = "model file"
    fitter = ""

    @functools.cached_property
    def id(self) -> str:
        return hashlib.sha256(self.file_bytes).hexdigest()[:32]

    @property
    def nbytes(self) -> int:
        return len(self.file_bytes)

    def file_header(self, schema: str, version: int, levels: dict, shapes: dict) -> dict:
        """The header fields every model file has (``levels`` as JSON, ``shapes`` of its
        arrays)."""
        return {
            "schema": schema,
            "version": version,
            "model": self.model.to_dict(),
            "calibration": self.calibration,
            "rope_thetas": list(self.rope_thetas),
            "levels": levels,
            "arrays": shapes,
        }

    def check_level_order(self, name: str) -> None:
        """``CodecError`` unless the levels are in increasing order (``name`` their kind)."""
        if list(self.levels) != sorted(self.levels):
            raise CodecError(f"{name} levels must be in increasing order, got {list(self.levels)}")

    def level_index(self, level: int) -> int:
        """Where ``level`` is in the per-level arrays; ``CodecError`` if it is not a level."""
        if level not in self.levels:
            raise CodecError(
                f"the {self.kind} {self.id[:16]} of {self.model.name} has no level {level}; "
                f"levels are {sorted(self.levels)}"
            )
        return list(self.levels).index(level)

    def check_model(self, model: ModelIdentity) -> None:
        """``CodecError`` unless this file was fitted for ``model``."""
        mine = self.model
        if not same_model(mine, model):
            raise CodecError(
                f"the {self.kind} {self.id[:16]} was fitted for model {mine.name} "
                f"({mine.fingerprint[:12]}), not {model.name} ({model.fingerprint[:12]}); "
                f"fit one for {model.name} ({self.fitter})"
            )


def _canonical(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def pack_model_file(magic: bytes, header: dict, payload: bytes) -> bytes:
    """``magic``, the u32 length of the canonical JSON ``header`` (with the payload's SHA-256
    added), the header, then ``payload``."""
    raw = _canonical({**header, "payload_sha256": hashlib.sha256(payload).hexdigest()})
    return magic + struct.pack("<I", len(raw)) + raw + payload


def unpack_model_file(
    data: bytes, magic: bytes, schema: str, version: int | tuple[int, ...]
) -> tuple[dict, bytes]:
    """The header and payload of a :func:`pack_model_file` file, its framing, schema, version
    (``version`` or one of them) and payload checksum checked (``ValueError`` otherwise)."""
    versions = version if isinstance(version, tuple) else (version,)
    if data[:4] != magic:
        raise ValueError("bad magic")
    (header_len,) = struct.unpack_from("<I", data, 4)
    if header_len > _MAX_HEADER_JSON or 8 + header_len > len(data):
        raise ValueError("header length is out of range")
    header = json.loads(data[8 : 8 + header_len])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    if header.get("schema") != schema or header.get("version") not in versions:
        raise ValueError(f"unsupported {header.get('schema')!r} version {header.get('version')!r}")
    payload = data[8 + header_len :]
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise ValueError("checksum of the arrays does not match")
    return header, payload


def pack_arrays(obj, specs: dict) -> tuple[bytes, dict]:
    """The payload bytes of ``obj``'s arrays named in ``specs`` (name -> (dtype, shape of
    (layers, channels, levels))), one after another, and their shapes for the header."""
    arrays = {name: getattr(obj, name) for name in specs}
    payload = b"".join(
        np.ascontiguousarray(arrays[name], dtype=specs[name][0]).tobytes() for name in specs
    )
    return payload, {name: list(arrays[name].shape) for name in specs}


def read_arrays(
    header: dict, payload: bytes, specs: dict, model: ModelIdentity, levels: int
) -> tuple[dict, int]:
    """The arrays :func:`pack_arrays` wrote, each shape checked against ``model``'s geometry
    and ``levels`` (``ValueError``), and the payload offset after them."""
    L, C = model.num_layers, model.num_kv_heads * model.head_dim
    arrays, pos = {}, 0
    for name, (dtype, shape_of) in specs.items():
        shape = shape_of(L, C, levels)
        if list(shape) != header["arrays"][name]:
            raise ValueError(f"{name} has shape {header['arrays'][name]}, expected {list(shape)}")
        count = int(np.prod(shape))
        size = count * np.dtype(dtype).itemsize
        if pos + size > len(payload):
            raise ValueError("arrays are truncated")
        arrays[name] = np.frombuffer(payload, dtype=dtype, count=count, offset=pos)
        arrays[name] = arrays[name].reshape(shape).copy()
        pos += size
    return arrays, pos


def read_rope_thetas(header: dict, model: ModelIdentity) -> tuple[float, ...]:
    """The header's rotary bases, one per layer (``ValueError`` otherwise)."""
    thetas = tuple(float(t) for t in header["rope_thetas"])
    if len(thetas) != model.num_layers:
        raise ValueError("rope_thetas does not have one base per layer")
    return thetas


def parse_model_file(data: bytes, where: str, file_id: str | None, what: str, parse):
    """``parse(data)`` of a model file named ``where``, its content hash checked against
    ``file_id`` when given; any defect becomes a :class:`CodecError` saying what to do."""
    if file_id is not None and hashlib.sha256(data).hexdigest()[:32] != file_id:
        raise CodecError(
            f"{what} {where} is corrupt (checksum does not match its id {file_id[:16]}); "
            "delete the file and copy or refit it"
        )
    try:
        return parse(data)
    except (ValueError, KeyError, TypeError, struct.error, KVError) as exc:
        raise CodecError(
            f"{what} {where} is unreadable ({exc}); delete the file and copy or refit it"
        ) from exc


def transforms_dir() -> Path:
    return profiles_dir() / "transforms"


class ModelFileRefused(TablesRefused):
    """A provider holds the model file asked for, but it fails a check (the provider's, its
    own, or it is another model's): it is neither used nor kept, and a decode that needs it
    fails with this reason. Like refused tables, nothing is wrong with the bitstreams."""


class ModelFileMissing(TablesMissing):
    """No local directory or provider holds the model file a bitstream names; the bitstream
    is sound."""


@runtime_checkable
class ModelFileProvider(Protocol):
    """A table provider that serves model files too, by id."""

    def read_model_file(self, file_id: str) -> bytes | None:
        """The file's bytes, or None if this provider does not hold it."""

    def describe(self) -> str:
        """Where this provider looks, for error messages."""


class ModelFiles:
    """Content-addressed model files of one kind in the transforms directory (``<id><suffix>``),
    kept in memory once read or written; one missing there comes from a provider that has it.
    An object stored here is a :class:`ModelFile`; ``parse(data, where, id)`` reads and
    validates one (``CodecError``). ``what`` names the kind in messages, ``fit`` says how to
    make a missing one; ``shipped`` is a read-only directory of files that ship with the
    package (``<id><suffix>`` too), read after the transforms directory."""

    def __init__(self, what: str, suffix: str, parse, fit: str, shipped: Path | None = None):
        self.what, self.suffix, self.parse, self.fit = what, suffix, parse, fit
        self.shipped = shipped
        self._cache: dict = {}
        self._lock = threading.Lock()

    def shipped_ids(self) -> list[str]:
        """The ids of the files shipped with the package."""
        paths = sorted(self.shipped.glob(f"*{self.suffix}")) if self.shipped else []
        return [path.name.removesuffix(self.suffix) for path in paths]

    def shipped_for(self, model: ModelIdentity, calibration: dict):
        """The shipped file fitted for ``model`` by ``calibration`` (its recipe), or None;
        every shipped file is checked (``CodecError`` if one is corrupt)."""
        for file_id in self.shipped_ids():
            obj = self._cached(file_id, model)
            if same_model(obj.model, model) and obj.calibration == calibration:
                return obj
        return None

    def path(self, file_id: str) -> Path:
        return transforms_dir() / f"{file_id}{self.suffix}"

    def save(self, obj):
        """Store ``obj`` in the transforms directory (by content id) and keep it in memory."""
        path = self.path(obj.id)
        if not path.is_file():
            write_atomic(path, obj.file_bytes)
        with self._lock:
            self._cache[obj.id] = obj
        return obj

    def find(self, file_id: str, model: ModelIdentity):
        """The file ``file_id`` for ``model``: from memory, else read and validated from the
        transforms directory, the shipped files or a provider; ``CodecError`` if it is
        missing, corrupt or another model's (``ModelFileRefused`` when a provider's copy is)."""
        obj = self._cached(file_id, model)
        obj.check_model(model)
        return obj

    def _cached(self, file_id: str, model: ModelIdentity):
        with self._lock:
            obj = self._cache.get(file_id)
        if obj is None:
            obj = self._read(file_id, model)
            with self._lock:
                self._cache[file_id] = obj
        return obj

    def _read(self, file_id: str, model: ModelIdentity):
        path = self.path(file_id)
        shipped = [self.shipped] if self.shipped else []
        for candidate in (path, *(directory / path.name for directory in shipped)):
            if candidate.is_file():
                return self.parse(candidate.read_bytes(), str(candidate), file_id)
        sources = [p for p in providers() if isinstance(p, ModelFileProvider)]
        for provider in sources:
            data = provider.read_model_file(file_id)
            if data is not None:
                return self._provided(data, file_id, model, provider)
        where = ", ".join(
            [str(d) for d in (transforms_dir(), *shipped)] + [p.describe() for p in sources]
        )
        raise ModelFileMissing(
            f"{self.what} {file_id[:16]} for {model.name} is not in {where}; copy "
            f"{path.name} from the encoding machine or fit it ({self.fit})"
        )

    def _provided(self, data: bytes, file_id: str, model: ModelIdentity, provider):
        """The file ``provider`` returned, checked before any use and kept locally."""
        where = f"{file_id[:16]} in {provider.describe()}"
        try:
            obj = self.parse(data, where, file_id)
            obj.check_model(model)
        except CodecError as exc:
            raise ModelFileRefused(f"the {self.what} {where} is refused ({exc})") from exc
        with contextlib.suppress(OSError):  # a read-only cache directory is no reason to fail
            self.save(obj)
        return obj

    def forget(self) -> None:
        with self._lock:
            self._cache.clear()


class ModelFileRef:
    """Where a model's current model file of one kind is named: ``<codec>.json`` next to its
    cachegen profile, ``{field: id, "calibration": ...}`` in ``schema`` (a ``(name, version)``).
    ``what`` names the kind in messages, ``fitter`` is what fits one, ``files`` where they
    are (:class:`ModelFiles`)."""

    def __init__(self, what: str, codec: str, schema: tuple, field: str, fitter: str, files):
        self.what, self.codec, self.field, self.fitter = what, codec, field, fitter
        self.schema, self.version = schema
        self.files = files

    def path(self, model: ModelIdentity) -> Path:
        return profile_path(model).parent / f"{self.codec}.json"

    def read(self, model: ModelIdentity) -> dict | None:
        """``{field: id, "calibration": ...}`` of the model's file, or None."""
        path = self.path(model)
        if not path.is_file():
            return None
        try:
            data = check_version(
                json.loads(path.read_text()), self.schema, (self.version,), str(path)
            )
            return {self.field: str(data[self.field]), "calibration": dict(data["calibration"])}
        except (OSError, ValueError, KeyError, TypeError, CacheGenError) as exc:
            raise CodecError(
                f"{self.what} reference {path} is unreadable ({exc}); delete it and fit the "
                f"{self.what} again (any `cachegen eval --codec {self.codec}`)"
            ) from exc

    def write(self, obj: ModelFile) -> None:
        body = {self.field: obj.id, "calibration": obj.calibration}
        data = versioned(self.schema, self.version, body)
        write_atomic(self.path(obj.model), json.dumps(data, indent=1).encode() + b"\n")

    def load(self, model: str | models.ModelSpec):
        """The stored file of ``model``. Never fits one: ``CodecError`` says how."""
        spec = models.resolve(model) if isinstance(model, str) else model
        identity = spec.identity()
        ref = self.read(identity)
        if ref is None:
            raise CodecError(
                f"no {self.what} for {spec.name} in {self.path(identity).parent}; fit it with "
                f"{self.fitter} (any `cachegen eval --codec {self.codec}`)"
            )
        return self.files.find(ref[self.field], identity)
