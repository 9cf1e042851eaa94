"""What a store keeps next to its chunks for the codec: profile tables, model files, codec
profile documents and, per model and codec, the pointer to the adopted profile.

Kept apart from the chunks (their own file directory or Redis key space): ``list``, ``stats``
and ``evict`` never see them, and a chunk key can never name one. A backend stores them as
records of a ``kind`` (TABLES, MODEL_FILES, PROFILES or POINTERS) by name through the five
``_*_meta`` methods; a record is bound (and signed) to ``<kind>:<name>``, never a chunk key
(those have no ':').
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence

from cachegen.errors import CacheGenError
from cachegen.fileio import check_version, versioned
from cachegen.store import record
from cachegen.store.errors import ChunkCorrupt, ChunkTooLarge, StoreConfigError

# Profile tables (``cachegen.codec.coding.tables``) and model files
# (``cachegen.codec.transform.model_file``: a tcq model, a kvtc basis): content-addressed by their
# id (the first 32 hex of the SHA-256 of the file), written once.
FILE_ID_RE = re.compile(r"^[0-9a-f]{32}\Z")
MAX_TABLES_BYTES = 64 << 20  # far above any model's tables file; bounds what a read accepts
MAX_MODEL_FILE_BYTES = 64 << 20  # far above any model file; bounds what a read accepts
# Codec profile documents (``cachegen.codec.cachegen.profile``): content-addressed by the
# profile id (the first 16 hex of the SHA-256 of the canonical document), written once; and per
# model and codec the "adopted" pointer naming the profile every producer and consumer of the store
# uses, written once by the first producer and never replaced.
PROFILE_ID_RE = re.compile(r"^[0-9a-f]{16}\Z")
FINGERPRINT_RE = re.compile(r"^[0-9a-f]{16,64}\Z")
CODEC_NAME_RE = re.compile(r"^[a-z0-9-]{1,32}\Z")
MAX_PROFILE_BYTES = 1 << 20  # a profile is a few KiB of JSON; bounds what a read accepts
POINTER_SCHEMA = "cachegen-adopted-profile"
POINTER_VERSION = 1
TABLES, MODEL_FILES = "tables", "model-files"  # the kinds of content-addressed files
PROFILES, POINTERS = "profiles", "adopted"  # the other kinds of records
# kind -> (what one is called in messages, the file to store unchanged)
_FILES = {
    TABLES: ("profile tables", "the tables file (<id>.cgtab)"),
    MODEL_FILES: ("model file", "the model file (<id>.cgtq or <id>.cgtr)"),
}


class ProfileRecords:
    """The profile side of a ``ChunkStore``: tables, model files, profiles and adopted-profile
    pointers, each verified like a chunk record (checksum, the MAC with a secret) and against
    its id."""

    label: str
    signed: bool
    _signer: record.Signer | None = None

    def put_tables(self, tables_id: str, data: bytes) -> bool:
        """Store the profile tables file ``data`` under its id, once: nothing is written when a
        copy that passes its checks is already there (a damaged one is replaced). Returns
        whether it wrote. Signed like a record when the store has a secret."""
        return self._put_file(TABLES, tables_id, data, MAX_TABLES_BYTES)

    def get_tables(self, tables_id: str) -> bytes | None:
        """The profile tables file stored under ``tables_id``, verified (record checksum, the
        MAC with a secret, and the content hash against the id); None when not stored.
        ``ChunkCorrupt`` (``ChunkForged``) when it fails a check."""
        return self._get_file(TABLES, tables_id, MAX_TABLES_BYTES)

    def put_model_file(self, file_id: str, data: bytes) -> bool:
        """Store the model file ``data`` (a tcq model, a kvtc basis) under its id, once, as
        :meth:`put_tables` stores tables."""
        return self._put_file(MODEL_FILES, file_id, data, MAX_MODEL_FILE_BYTES)

    def get_model_file(self, file_id: str) -> bytes | None:
        """The model file stored under ``file_id``, verified as :meth:`get_tables` verifies
        tables; None when not stored."""
        return self._get_file(MODEL_FILES, file_id, MAX_MODEL_FILE_BYTES)

    def _put_file(self, kind: str, file_id: str, data: bytes, cap: int) -> bool:
        """Store the content-addressed file ``data`` of ``kind`` under its id unless a valid
        copy is there; ``ChunkTooLarge`` when its record would pass ``cap`` bytes."""
        what, file = _FILES[kind]
        _check(FILE_ID_RE, f"a {what} id is 32 lowercase hex digits", file_id)
        if _file_hash(data) != file_id:
            raise StoreConfigError(
                f"{describe(kind, file_id)}: the {len(data)} bytes given do not hash to their "
                f"id; store {file} unchanged"
            )
        size = record.record_size(len(data), self.signed)
        if size > cap:
            raise ChunkTooLarge(
                f"{describe(kind, file_id)}: {size} bytes, over the {cap} a store holds"
            )
        return self._put_once(kind, file_id, data, lambda name: self._get_file(kind, name, cap))

    def _get_file(self, kind: str, file_id: str, cap: int) -> bytes | None:
        """The verified file ``file_id`` of ``kind`` (its record, then its hash against the
        id), or None when not stored."""
        _check(FILE_ID_RE, f"a {_FILES[kind][0]} id is 32 lowercase hex digits", file_id)
        payload = self._read_verified(kind, file_id, cap)
        if payload is not None and _file_hash(payload) != file_id:
            raise ChunkCorrupt(
                f"{describe(kind, file_id)} in {self.label}: the content does not hash to its id"
            )
        return payload

    def put_profile(self, profile_id: str, document: bytes) -> bool:
        """Store the canonical profile document ``document`` under its id, once: nothing is
        written when a copy that passes its checks is there (a damaged one is replaced).
        Returns whether it wrote."""
        _check(PROFILE_ID_RE, "a profile id is 16 lowercase hex digits", profile_id)
        if _profile_hash(document) != profile_id:
            raise StoreConfigError(
                f"a profile document of {len(document)} bytes does not hash to its id "
                f"{profile_id}; store the canonical document (cachegen.codec.cachegen.profile)"
            )
        if record.record_size(len(document), self.signed) > MAX_PROFILE_BYTES:
            raise ChunkTooLarge(
                f"profile {profile_id}: over the {MAX_PROFILE_BYTES} bytes a store holds"
            )
        return self._put_once(PROFILES, profile_id, document, self.get_profile)

    def get_profile(self, profile_id: str) -> bytes | None:
        """The profile document stored under ``profile_id``, verified (record checksum, the MAC
        with a secret, the content hash against the id); None when not stored. ``ChunkCorrupt``
        (``ChunkForged``) when it fails a check."""
        _check(PROFILE_ID_RE, "a profile id is 16 lowercase hex digits", profile_id)
        document = self._read_verified(PROFILES, profile_id, MAX_PROFILE_BYTES)
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
        name = pointer_name(fingerprint, codec)
        _check(PROFILE_ID_RE, "a profile id is 16 lowercase hex digits", profile_id)
        body = {"model": {"name": model_name, "fingerprint": fingerprint}, "codec": codec}
        doc = versioned(POINTER_SCHEMA, POINTER_VERSION, {**body, "profile": profile_id})
        payload = json.dumps(doc, sort_keys=True).encode()
        data = record.pack(f"{POINTERS}:{name}", 0, payload, self._signer)
        return self._write_meta(POINTERS, name, data, exclusive=True)

    def adopted_profile(self, fingerprint: str, codec: str) -> str | None:
        """The profile id the store's pointer for the model ``fingerprint`` and ``codec`` names;
        None when there is no pointer. ``ChunkCorrupt`` when the pointer fails a check."""
        name = pointer_name(fingerprint, codec)
        payload = self._read_verified(POINTERS, name, MAX_PROFILE_BYTES)
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

    def missing_records(self, records: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """Those of ``records`` the store does not hold, each a ``(kind, name)``: (TABLES,
        tables id), (MODEL_FILES, file id), (PROFILES, profile id) or (POINTERS,
        :func:`pointer_name`). Unverified and in one round trip: how a producer finds what was
        evicted or deleted, to put it back."""
        wanted = list(dict.fromkeys(records))
        for kind, name in wanted:
            _check_name(kind, name)
        return [item for item, held in zip(wanted, self._holds_meta(wanted)) if not held]

    def delete_pointer(self, fingerprint: str, codec: str) -> bool:
        """Remove the adopted-profile pointer of the model ``fingerprint`` for ``codec``, so the
        next producer's profile is adopted; returns whether there was one. Chunks stored under
        the old profile stay, but new readers look under the new profile's keys."""
        return self._delete_meta(POINTERS, pointer_name(fingerprint, codec))

    def _put_once(
        self, kind: str, name: str, payload: bytes, get: Callable[[str], bytes | None]
    ) -> bool:
        """Write ``payload`` as ``name`` of ``kind`` unless ``get(name)`` finds a valid copy."""
        try:
            if get(name) is not None:
                return False
        except ChunkCorrupt:
            pass  # damaged or signed with another secret: written again below
        data = record.pack(f"{kind}:{name}", 0, payload, self._signer)
        return self._write_meta(kind, name, data, exclusive=False)

    def _read_verified(self, kind: str, name: str, cap: int) -> bytes | None:
        data = self._read_meta(kind, name, cap)
        if data is None:
            return None
        return record.unpack(data, f"{kind}:{name}", 0, self._signer)

    def _read_meta(self, kind: str, name: str, cap: int) -> bytes | None:
        """The stored record ``name`` of ``kind``, unverified; None when absent;
        ``ChunkTooLarge`` (:func:`record_too_large`) over ``cap`` bytes, before reading it
        whole."""
        raise StoreConfigError(f"{type(self).__name__} does not hold codec profiles")

    def _write_meta(self, kind: str, name: str, data: bytes, *, exclusive: bool) -> bool:
        """Store the record ``data`` as ``name`` of ``kind`` atomically; ``exclusive``: only if
        there is none (returns False then, writing nothing). Returns whether it wrote."""
        raise StoreConfigError(f"{type(self).__name__} does not hold codec profiles")

    def _holds_meta(self, records: Sequence[tuple[str, str]]) -> list[bool]:
        """For each ``(kind, name)``, whether the store has that record (one round trip)."""
        raise StoreConfigError(f"{type(self).__name__} does not hold codec profiles")

    def _delete_meta(self, kind: str, name: str) -> bool:
        raise StoreConfigError(f"{type(self).__name__} does not hold codec profiles")

    def _list_meta(self, kind: str) -> list[str]:
        raise StoreConfigError(f"{type(self).__name__} does not hold codec profiles")


def describe(kind: str, name: str) -> str:
    """A record of ``kind`` named for messages."""
    what = _FILES[kind][0] if kind in _FILES else f"{kind} record"
    return f"{what} {name[:16]}"


def record_too_large(kind: str, name: str, size: int, cap: int) -> ChunkTooLarge:
    return ChunkTooLarge(
        f"{describe(kind, name)}: the stored record is {size} bytes, over the {cap} a store "
        "holds; refused without reading it"
    )


def _check(pattern: re.Pattern, what: str, value: object) -> None:
    if not isinstance(value, str) or not pattern.match(value):
        raise StoreConfigError(f"{what}, got {value!r}")


def _check_name(kind: str, name: str) -> None:
    """Raise ``StoreConfigError`` unless ``name`` is a valid name of a record of ``kind``."""
    if kind in _FILES:
        _check(FILE_ID_RE, f"a {_FILES[kind][0]} id is 32 lowercase hex digits", name)
    elif kind == PROFILES:
        _check(PROFILE_ID_RE, "a profile id is 16 lowercase hex digits", name)
    elif kind == POINTERS:
        fingerprint, _, codec = str(name).partition("-")
        pointer_name(fingerprint, codec)
    else:
        raise StoreConfigError(f"unknown kind of profile record {kind!r}")


def _file_hash(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _profile_hash(document: bytes | memoryview) -> str:
    return hashlib.sha256(document).hexdigest()[:16]


def pointer_name(fingerprint: str, codec: str) -> str:
    """A pointer's name: one per model weights and codec (a profile does not depend on the
    chunk size, which the chunk keys name on their own)."""
    _check(FINGERPRINT_RE, "a model fingerprint is 16 to 64 lowercase hex digits", fingerprint)
    _check(CODEC_NAME_RE, "a codec name is lowercase letters, digits and '-'", codec)
    return f"{fingerprint}-{codec}"
