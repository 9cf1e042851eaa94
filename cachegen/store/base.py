"""The chunk-store interface shared by every backend, and helpers built on it."""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

from cachegen.errors import CacheGenError
from cachegen.fileio import check_version, versioned
from cachegen.store import record
from cachegen.store.errors import ChunkCorrupt, ChunkTooLarge, StoreConfigError, StoreError

# Profile tables (``cachegen.codec.tables``) a store holds next to its chunks: content-addressed
# by their tables id (the first 32 hex of the SHA-256 of the tables file), written once.
TABLES_ID_RE = re.compile(r"^[0-9a-f]{32}$")
MAX_TABLES_BYTES = 64 << 20  # far above any model's tables file; bounds what a read accepts
# Codec profile documents (``cachegen.codec.profile``): content-addressed by the profile id (the
# first 16 hex of the SHA-256 of the canonical document), written once; and per model and codec
# the "adopted" pointer naming the profile every producer and consumer of the store uses,
# written once by the first producer and never replaced.
PROFILE_ID_RE = re.compile(r"^[0-9a-f]{16}$")
FINGERPRINT_RE = re.compile(r"^[0-9a-f]{16,64}$")
CODEC_NAME_RE = re.compile(r"^[a-z0-9-]{1,32}$")
MAX_PROFILE_BYTES = 1 << 20  # a profile is a few KiB of JSON; bounds what a read accepts
POINTER_SCHEMA = "cachegen-adopted-profile"
POINTER_VERSION = 1
PROFILES, POINTERS = "profiles", "adopted"  # the two kinds of profile records


@dataclass(frozen=True)
class ChunkInfo:
    """One stored (key, level): payload size in bytes and last use (Unix seconds, or None)."""

    key: str
    level: int
    size: int
    last_used: float | None = None


@dataclass(frozen=True)
class StoreStats:
    url: str
    chunks: int  # distinct keys
    entries: int  # (key, level) pairs
    payload_bytes: int
    capacity_bytes: int | None
    namespaces: dict[str, int]  # namespace -> entries

    def to_dict(self) -> dict:
        return asdict(self)


class ChunkStore(ABC):
    """Encoded chunks addressed by ``(key, level)``; keys come from :func:`chunk_keys`.

    Readers never see a partial chunk: ``get`` returns a payload verified against the
    checksum written with it, or raises ``ChunkMissing`` / ``ChunkCorrupt`` /
    ``StoreUnavailable``. Stores are safe to share between threads.

    A store opened with a secret signs every record it writes (record format version 2) and
    refuses, with ``ChunkForged``, any record not signed with that secret for that key and
    level. ``max_record_bytes`` bounds the records it writes and reads (``ChunkTooLarge``).
    """

    url: str
    max_record_bytes: int | None = None
    _signer: record.Signer | None = None

    def _init_records(self, secret, max_record_bytes: int | None) -> None:
        """Backends call this first: the secret (None: ``CACHEGEN_STORE_SECRET``) and cap."""
        if max_record_bytes is not None and max_record_bytes < record.HEADER_SIZE_SIGNED:
            raise StoreConfigError(
                f"max_record_bytes must be at least {record.HEADER_SIZE_SIGNED} (a record "
                f"header), got {max_record_bytes}"
            )
        self.max_record_bytes = max_record_bytes
        self._signer = record.signer_for(secret)

    @property
    def signed(self) -> bool:
        """Whether this store signs its records and accepts only records signed with its secret."""
        return self._signer is not None

    @property
    def record_signer(self) -> record.Signer | None:
        """What verifies this store's records elsewhere (``SocketSource(..., secret=...)``)."""
        return self._signer

    @property
    def label(self) -> str:
        """The URL without secrets, for messages and reports."""
        return self.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r}, signed={self.signed})"

    def _pack(self, key: str, level: int, blob: bytes) -> bytes:
        """The record to store for ``blob`` (signed if this store has a secret), size-checked."""
        self._check_record_size(
            key, level, record.record_size(len(blob), self.signed), writing=True
        )
        return record.pack(key, level, blob, self._signer)

    def _check_record_size(self, key: str, level: int, size: int, *, writing: bool = False) -> None:
        cap = self.max_record_bytes
        if cap is None or size <= cap:
            return
        what = "not stored" if writing else "refused without reading it"
        raise ChunkTooLarge(
            f"chunk {key} level {level} in {self.label}: the record is {size} bytes, over this "
            f"store's max_record_bytes of {cap}, so it is {what}; raise the store option "
            "max_record_bytes (URL ?max_record_bytes=SIZE or open_store(..., "
            "max_record_bytes=...)) if chunks this large are expected"
        )

    @abstractmethod
    def put(self, key: str, level: int, blob: bytes) -> None:
        """Store ``blob`` (replacing any previous one) atomically."""

    @abstractmethod
    def get_record(self, key: str, level: int) -> bytes:
        """The stored record (header + payload) unverified, for forwarding to a remote reader.

        A record over ``max_record_bytes`` raises ``ChunkTooLarge`` before it is read whole.
        """

    def get(self, key: str, level: int) -> bytes:
        """The verified payload of ``(key, level)``."""
        return record.unpack(self.get_record(key, level), key, level, self._signer)

    def get_records(self, items: Sequence[tuple[str, int]]) -> list[bytes | StoreError]:
        """The stored records of several ``(key, level)`` pairs, unverified, in order.

        Each pair that cannot be read holds the ``StoreError`` that ``get_record`` would have
        raised for it, so one missing chunk does not hide the others. Backends with round
        trips fetch them in one (a pipeline); this default reads them one by one.
        """
        out: list[bytes | StoreError] = []
        for key, level in items:
            try:
                out.append(self.get_record(key, level))
            except StoreError as exc:
                out.append(exc)
        return out

    def get_many(self, items: Sequence[tuple[str, int]]) -> list[bytes | StoreError]:
        """The verified payloads of several ``(key, level)`` pairs (see ``get_records``)."""
        out: list[bytes | StoreError] = []
        for (key, level), found in zip(items, self.get_records(items)):
            if not isinstance(found, StoreError):
                try:
                    found = record.unpack(found, key, level, self._signer)
                except StoreError as exc:
                    found = exc
            out.append(found)
        return out

    def get_stream(self, key: str, level: int, block_size: int = 1 << 20) -> Iterator[bytes]:
        """The verified payload in blocks of at most ``block_size`` bytes.

        Blocks are provisional until the iterator ends: a damaged payload raises
        ``ChunkCorrupt`` after its last block. Backends read byte ranges via ``_read_range``.
        """
        offset = 0

        def read(n: int) -> bytes:
            nonlocal offset
            data = self._read_range(key, level, offset, n)
            offset += len(data)
            return data

        return record.iter_payload(
            read, key, level, block_size, self._signer, self._size_check(key, level)
        )

    def _size_check(self, key: str, level: int):
        if self.max_record_bytes is None:
            return None
        return lambda size: self._check_record_size(key, level, size)

    def _read_range(self, key: str, level: int, offset: int, length: int) -> bytes:
        return self.get_record(key, level)[offset : offset + length]

    @abstractmethod
    def exists_many(self, keys: Sequence[str], level: int) -> list[bool]:
        """For each key, whether it is stored at ``level`` (one round trip where possible)."""

    def exists(self, key: str, level: int) -> bool:
        return self.exists_many([key], level)[0]

    @abstractmethod
    def levels(self, key: str) -> list[int]:
        """Levels stored for ``key``, ascending."""

    @abstractmethod
    def sizes(self, keys: Sequence[str], level: int) -> list[int | None]:
        """Payload bytes of each key at ``level`` (None where missing)."""

    @abstractmethod
    def delete(self, key: str, level: int | None = None) -> int:
        """Remove one level (or all levels) of ``key``; returns entries removed."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ChunkInfo]:
        """Every stored entry whose key starts with ``prefix``."""

    @abstractmethod
    def evict(self, max_bytes: int) -> int:
        """Remove least recently used entries until at most ``max_bytes`` of payload remain.

        Returns the number of entries removed; ``evict(0)`` empties the store.
        """

    @property
    def capacity_bytes(self) -> int | None:
        return None

    # ---- profile tables --------------------------------------------------------------------
    # Kept apart from the chunks (their own file directory or Redis key space): ``list``,
    # ``stats`` and ``evict`` never see them, and a chunk key can never name one.

    def put_tables(self, tables_id: str, data: bytes) -> bool:
        """Store the profile tables file ``data`` under its id, once: nothing is written when a
        copy that passes its checks is already there (a damaged one is replaced). Returns
        whether it wrote. Signed like a record when the store has a secret."""
        _check_tables_id(tables_id)
        if _tables_hash(data) != tables_id:
            raise StoreConfigError(
                f"profile tables of {len(data)} bytes do not hash to their id {tables_id[:16]}; "
                "store the tables file (<id>.cgtab) unchanged"
            )
        size = record.record_size(len(data), self.signed)
        if size > MAX_TABLES_BYTES:
            raise ChunkTooLarge(
                f"profile tables {tables_id[:16]}: {size} bytes, over the {MAX_TABLES_BYTES} a "
                "store holds"
            )
        try:
            if self.get_tables(tables_id) is not None:
                return False
        except ChunkCorrupt:
            pass  # damaged or signed with another secret: written again below
        self._write_tables_record(
            tables_id, record.pack(_tables_record_key(tables_id), 0, data, self._signer)
        )
        return True

    def get_tables(self, tables_id: str) -> bytes | None:
        """The profile tables file stored under ``tables_id``, verified (record checksum, the
        MAC with a secret, and the content hash against the id); None when not stored.
        ``ChunkCorrupt`` (``ChunkForged``) when it fails a check."""
        _check_tables_id(tables_id)
        data = self._read_tables_record(tables_id, MAX_TABLES_BYTES)
        if data is None:
            return None
        key = _tables_record_key(tables_id)
        payload = record.unpack(data, key, 0, self._signer)
        if _tables_hash(payload) != tables_id:
            raise ChunkCorrupt(
                f"profile tables {tables_id[:16]} in {self.label}: the content does not hash to "
                "its id"
            )
        return payload

    def _read_tables_record(self, tables_id: str, cap: int) -> bytes | None:
        """The stored record of ``tables_id`` unverified, None when absent; ``ChunkTooLarge``
        over ``cap`` bytes, before reading it whole."""
        raise StoreConfigError(f"{type(self).__name__} does not hold profile tables")

    def _write_tables_record(self, tables_id: str, data: bytes) -> None:
        """Store the record ``data`` of ``tables_id`` atomically (replacing any)."""
        raise StoreConfigError(f"{type(self).__name__} does not hold profile tables")

    # ---- codec profiles --------------------------------------------------------------------
    # Kept apart from the chunks like the tables. A backend stores them through the four
    # ``_*_meta`` methods: records of ``kind`` (PROFILES or POINTERS) by name.

    def put_profile(self, profile_id: str, document: bytes) -> bool:
        """Store the canonical profile document ``document`` under its id, once: nothing is
        written when a copy that passes its checks is there (a damaged one is replaced).
        Returns whether it wrote."""
        _check(PROFILE_ID_RE, "a profile id is 16 lowercase hex digits", profile_id)
        if _profile_hash(document) != profile_id:
            raise StoreConfigError(
                f"a profile document of {len(document)} bytes does not hash to its id "
                f"{profile_id}; store the canonical document (cachegen.codec.profile)"
            )
        if record.record_size(len(document), self.signed) > MAX_PROFILE_BYTES:
            raise ChunkTooLarge(
                f"profile {profile_id}: over the {MAX_PROFILE_BYTES} bytes a store holds"
            )
        try:
            if self.get_profile(profile_id) is not None:
                return False
        except ChunkCorrupt:
            pass  # damaged or signed with another secret: written again below
        data = record.pack(f"{PROFILES}:{profile_id}", 0, document, self._signer)
        return self._write_meta(PROFILES, profile_id, data, exclusive=False)

    def get_profile(self, profile_id: str) -> bytes | None:
        """The profile document stored under ``profile_id``, verified (record checksum, the MAC
        with a secret, the content hash against the id); None when not stored. ``ChunkCorrupt``
        (``ChunkForged``) when it fails a check."""
        _check(PROFILE_ID_RE, "a profile id is 16 lowercase hex digits", profile_id)
        document = self._read_verified(PROFILES, profile_id)
        if document is not None and _profile_hash(document) != profile_id:
            raise ChunkCorrupt(
                f"profile {profile_id} in {self.label}: the document does not hash to its id"
            )
        return document

    def profile_ids(self) -> list[str]:
        """The ids of the stored profile documents (unverified), sorted."""
        return sorted(n for n in self._list_meta(PROFILES) if PROFILE_ID_RE.match(n))

    def adopt_profile(self, fingerprint: str, codec: str, profile_id: str, model_name: str) -> bool:
        """Make ``profile_id`` the adopted profile of the model ``fingerprint`` for ``codec``
        unless the store has one (valid or not): first writer wins, atomically, and a pointer is
        never replaced (``delete_pointer`` removes it). Returns whether it wrote."""
        name = _pointer_name(fingerprint, codec)
        _check(PROFILE_ID_RE, "a profile id is 16 lowercase hex digits", profile_id)
        body = {"model": {"name": model_name, "fingerprint": fingerprint}, "codec": codec}
        doc = versioned(POINTER_SCHEMA, POINTER_VERSION, {**body, "profile": profile_id})
        payload = json.dumps(doc, sort_keys=True).encode()
        data = record.pack(f"{POINTERS}:{name}", 0, payload, self._signer)
        return self._write_meta(POINTERS, name, data, exclusive=True)

    def adopted_profile(self, fingerprint: str, codec: str) -> str | None:
        """The profile id the store's pointer for the model ``fingerprint`` and ``codec`` names;
        None when there is no pointer. ``ChunkCorrupt`` when the pointer fails a check."""
        name = _pointer_name(fingerprint, codec)
        payload = self._read_verified(POINTERS, name)
        if payload is None:
            return None
        try:
            doc = check_version(json.loads(payload), POINTER_SCHEMA, (POINTER_VERSION,), "pointer")
            profile_id = doc["profile"]
            if doc["model"]["fingerprint"] != fingerprint or doc["codec"] != codec:
                raise ValueError("it names another model or codec")
            _check(PROFILE_ID_RE, "not a profile id", profile_id)
        except (ValueError, KeyError, TypeError, CacheGenError) as exc:
            raise ChunkCorrupt(
                f"the adopted-profile pointer {name[:16]}.. in {self.label} is unreadable ({exc})"
            ) from exc
        return profile_id

    def pointers(self) -> list[tuple[str, str]]:
        """``(fingerprint, codec)`` of every stored adopted-profile pointer, sorted."""
        found = (n.partition("-") for n in self._list_meta(POINTERS))
        return sorted((fp, codec) for fp, _, codec in found if FINGERPRINT_RE.match(fp) and codec)

    def delete_pointer(self, fingerprint: str, codec: str) -> bool:
        """Remove the adopted-profile pointer of the model ``fingerprint`` for ``codec``, so the
        next producer's profile is adopted; returns whether there was one. Chunks stored under
        the old profile stay, but new readers look under the new profile's keys."""
        return self._delete_meta(POINTERS, _pointer_name(fingerprint, codec))

    def _read_verified(self, kind: str, name: str) -> bytes | None:
        data = self._read_meta(kind, name, MAX_PROFILE_BYTES)
        if data is None:
            return None
        return record.unpack(data, f"{kind}:{name}", 0, self._signer)

    def _read_meta(self, kind: str, name: str, cap: int) -> bytes | None:
        """The stored record ``name`` of ``kind``, unverified; None when absent;
        ``ChunkTooLarge`` over ``cap`` bytes, before reading it whole."""
        raise StoreConfigError(f"{type(self).__name__} does not hold codec profiles")

    def _write_meta(self, kind: str, name: str, data: bytes, *, exclusive: bool) -> bool:
        """Store the record ``data`` as ``name`` of ``kind`` atomically; ``exclusive``: only if
        there is none (returns False then, writing nothing). Returns whether it wrote."""
        raise StoreConfigError(f"{type(self).__name__} does not hold codec profiles")

    def _delete_meta(self, kind: str, name: str) -> bool:
        raise StoreConfigError(f"{type(self).__name__} does not hold codec profiles")

    def _list_meta(self, kind: str) -> list[str]:
        raise StoreConfigError(f"{type(self).__name__} does not hold codec profiles")

    def stats(self) -> StoreStats:
        keys: set[str] = set()
        namespaces: dict[str, int] = {}
        entries = total = 0
        for info in self.list():
            keys.add(info.key)
            entries += 1
            total += info.size
            ns = info.key.split("/", 1)[0]
            namespaces[ns] = namespaces.get(ns, 0) + 1
        return StoreStats(self.label, len(keys), entries, total, self.capacity_bytes, namespaces)

    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_tables_id(tables_id: str) -> None:
    if not isinstance(tables_id, str) or not TABLES_ID_RE.match(tables_id):
        raise StoreConfigError(f"a profile tables id is 32 lowercase hex digits, got {tables_id!r}")


def _tables_hash(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _tables_record_key(tables_id: str) -> str:
    """What a tables record is bound (and signed) to: never a chunk key (those have no ':')."""
    return f"tables:{tables_id}"


def _check(pattern: re.Pattern, what: str, value: object) -> None:
    if not isinstance(value, str) or not pattern.match(value):
        raise StoreConfigError(f"{what}, got {value!r}")


def _profile_hash(document: bytes | memoryview) -> str:
    return hashlib.sha256(document).hexdigest()[:16]


def _pointer_name(fingerprint: str, codec: str) -> str:
    """A pointer's name: one per model weights and codec (a profile does not depend on the
    chunk size, which the chunk keys name on their own)."""
    _check(FINGERPRINT_RE, "a model fingerprint is 16 to 64 lowercase hex digits", fingerprint)
    _check(CODEC_NAME_RE, "a codec name is lowercase letters, digits and '-'", codec)
    return f"{fingerprint}-{codec}"


def meta_too_large(kind: str, name: str, size: int) -> ChunkTooLarge:
    return ChunkTooLarge(
        f"{kind} record {name[:16]}: {size} bytes stored, over the {MAX_PROFILE_BYTES} a store "
        "holds; refused without reading it"
    )


def tables_too_large(tables_id: str, size: int) -> ChunkTooLarge:
    return ChunkTooLarge(
        f"profile tables {tables_id[:16]}: the stored record is {size} bytes, over the "
        f"{MAX_TABLES_BYTES} a store holds; refused without reading it"
    )


def longest_prefix(store: ChunkStore, keys: Sequence[str], levels: int | Sequence[int]) -> int:
    """How many leading ``keys`` are stored at every one of ``levels``.

    Keys are chained hashes, so this is the length (in chunks) of the longest stored prefix
    of the token sequence the keys were derived from.
    """
    wanted = [levels] if isinstance(levels, int) else list(levels)
    present = [True] * len(keys)
    for level in wanted:
        present = [a and b for a, b in zip(present, store.exists_many(keys, level))]
    for i, ok in enumerate(present):
        if not ok:
            return i
    return len(keys)
