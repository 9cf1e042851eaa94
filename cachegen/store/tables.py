"""A chunk store as a source of profile tables and model files, so that they travel with the
chunks.

A producer puts the tables its chunks name into the store (:func:`publish_tables`, once per
tables id: the store keeps the first valid copy), and the model file of a transform codec
(:func:`publish_model_file`: a tcq model, a kvtc basis) likewise. A consumer adds the store as
a table provider (:class:`StoreTables`, ``cachegen.codec.coding.tables.add_provider``; the one call
provides both) and decodes with an empty cache directory and no model weights: ``find_tables``
and ``ModelFiles.find`` ask the store for what they do not have. What the store returns is
verified (record checksum, the MAC when the store has a secret, the content hash against the
id, the file's own checks, and the bitstream's model); what fails is refused with
``TablesRefused`` (``ModelFileRefused`` for a model file).

The profile travels too (:func:`resolve_profile`): the store keeps profile documents by id
and, per model and codec, a pointer to the profile its chunks use, written once by the first
producer. A transport adopts the pointed-to profile (document and tables checked) instead of
its own, so that its chunk keys, which name the profile, are the producer's; without a
pointer it publishes its own profile and points to it.

What a store loses of them (an eviction, an operator's delete) a producer puts back:
:func:`republish_profile` and :func:`republish_model_file` look for its records in one round
trip and store again only the missing ones.

This module imports the codec, so only code that decodes or encodes imports it; a chunk
server reads stores without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cachegen.codec.cachegen.profile import Profile, profile_document, profile_from_document
from cachegen.codec.coding.tables import (
    LOCAL,
    TablesRefused,
    add_provider,
    parse_tables,
    remove_provider,
)
from cachegen.codec.errors import CodecError
from cachegen.codec.transform.model_file import ModelFile, ModelFileRefused, same_model
from cachegen.kv import ModelIdentity
from cachegen.store.base import ChunkStore
from cachegen.store.errors import ChunkCorrupt, ChunkTooLarge, StoreError
from cachegen.store.profile_records import (
    MODEL_FILES,
    POINTERS,
    PROFILES,
    TABLES,
    describe,
    pointer_name,
)


class StoreTables:
    """A ``TableProvider`` that reads profile tables and model files from ``store``; each
    table file is kept in the local tables directory (so later processes need not ask again),
    each model file in the transforms directory (by ``ModelFiles.find``, once checked)."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store

    def read_tables(self, tables_id: str) -> bytes | None:
        data = self._read(self.store.get_tables, tables_id, "profile tables", TablesRefused)
        if data is None:
            return None
        parse_tables(data, tables_id, f"{tables_id[:16]} in {self.describe()}")
        with contextlib.suppress(OSError):  # a read-only cache directory is no reason to fail
            LOCAL.write_tables(tables_id, data)
        return data

    def read_model_file(self, file_id: str) -> bytes | None:
        return self._read(self.store.get_model_file, file_id, "model file", ModelFileRefused)

    def _read(self, get: Callable, file_id: str, what: str, refused: type) -> bytes | None:
        """``get(file_id)``: the store's verified copy, None when it has none or cannot be
        reached (the decode then fails as for a file nobody has); ``refused`` when it fails a
        check."""
        try:
            return get(file_id)
        except (ChunkCorrupt, ChunkTooLarge) as exc:
            raise refused(
                f"{what} {file_id[:16]} in {self.describe()}: refused ({exc}); the chunks that "
                "need it are recomputed until a producer that has it stores it again (a "
                "producer replaces a damaged copy with its first save after it starts)"
            ) from exc
        except StoreError:
            return None

    def describe(self) -> str:
        return f"the store {self.store.label}"


def publish_tables(store: ChunkStore, tables_ids: Iterable[str]) -> int:
    """Put the tables ``tables_ids`` from the local tables directory into ``store`` where it
    lacks a valid copy; returns the bytes written. Tables not in the local directory came from
    a provider (this store, when it is one) and are left alone."""
    written = 0
    for tables_id in dict.fromkeys(tables_ids):
        data = LOCAL.read_tables(tables_id)
        if data is not None and store.put_tables(tables_id, data):
            written += len(data)
    return written


def publish_model_file(store: ChunkStore, model_file: ModelFile) -> int:
    """Put ``model_file`` (a tcq model, a kvtc basis) into ``store`` unless it holds a valid
    copy; returns the bytes written."""
    return model_file.nbytes if store.put_model_file(model_file.id, model_file.file_bytes) else 0


def republish_model_file(store: ChunkStore, model_file: ModelFile) -> list[str]:
    """Put ``model_file`` back into ``store`` if the store lost it; returns what was put back
    (named for messages)."""
    if not store.missing_records([(MODEL_FILES, model_file.id)]):
        return []
    publish_model_file(store, model_file)
    return [describe(MODEL_FILES, model_file.id)]


def republish_profile(
    store: ChunkStore, profile: Profile, adopted: ModelIdentity | None, codec: str = "cachegen"
) -> list[str]:
    """Put back into ``store`` what it lost of ``profile``: its tables and, with ``adopted``
    (the model whose profile for ``codec`` this is), its document and the model's pointer to it
    (written only if there is none: another producer's may have come first). Returns what was
    put back (named for messages); tables not in the local tables directory cannot be."""
    wanted = [(TABLES, tables_id) for tables_id in profile.tables_ids.values()]
    if adopted is not None:
        wanted += [(PROFILES, profile.id), (POINTERS, pointer_name(adopted.fingerprint, codec))]
    restored = []
    for kind, name in store.missing_records(wanted):
        if kind == TABLES:
            written = publish_tables(store, [name]) > 0  # 0: not in the local directory
        elif kind == PROFILES:
            written = store.put_profile(profile.id, profile_document(profile))
        else:
            written = store.adopt_profile(adopted.fingerprint, codec, profile.id, adopted.name)
        if written:
            restored.append(describe(kind, name))
    return restored


# ---- the profile --------------------------------------------------------------------------


class ProfileRefused(CodecError):
    """The profile a store's pointer names cannot be used here: missing, damaged, of another
    model, or its tables fail their checks. The local profile is used instead; chunks stored
    under the store's profile are then not found (their keys name that profile)."""


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a transport uses, and where it came from: ``store`` (the store's adopted
    profile) or ``local`` (this machine's; ``adopted`` when this call made it the store's).
    ``refused``: why the store's profile was not used, if it has one."""

    profile: Profile
    source: str
    adopted: bool = False
    refused: str | None = None

    def to_dict(self) -> dict:
        return {
            "profile": self.profile.id,
            "source": self.source,
            "adopted": self.adopted,
            "refused": self.refused,
        }


def publish_profile(store: ChunkStore, profile: Profile) -> None:
    """Put ``profile``'s tables and then its document into ``store`` (each once)."""
    publish_tables(store, profile.tables_ids.values())
    store.put_profile(profile.id, profile_document(profile))


def load_stored_profile(store: ChunkStore, profile_id: str, model: ModelIdentity) -> Profile:
    """The profile ``profile_id`` from ``store`` with every level's tables, checked for use
    with ``model`` (same weights fingerprint and geometry); ``ProfileRefused`` says why not."""
    where = f"{profile_id} in {store.label}"
    try:
        data = store.get_profile(profile_id)
        if data is None:
            raise ProfileRefused(f"the store's adopted profile {where} is missing")
        profile = profile_from_document(data, where)
    except (ChunkCorrupt, ChunkTooLarge, CodecError) as exc:
        if isinstance(exc, ProfileRefused):
            raise
        raise ProfileRefused(f"the store's adopted profile {where} is refused ({exc})") from exc
    theirs, ours = profile.model, model
    if not same_model(theirs, ours):
        raise ProfileRefused(
            f"the store's profile {where} belongs to model {theirs.name} "
            f"({theirs.fingerprint[:12]}), not {ours.name} ({ours.fingerprint[:12]})"
        )
    provider = StoreTables(store)  # this store's tables, whatever providers are set up
    add_provider(provider)
    try:
        for level in sorted(profile.levels):
            try:
                profile.tables(level)
            except CodecError as exc:
                raise ProfileRefused(
                    f"the store's adopted profile {where}: the tables of level {level} are "
                    f"refused ({exc})"
                ) from exc
    finally:
        remove_provider(provider)
    return profile


def resolve_profile(
    store: ChunkStore,
    model: ModelIdentity,
    local: Callable[[], Profile],
    codec: str = "cachegen",
    *,
    publish: bool = True,
) -> ProfileChoice:
    """The profile to use with ``store``: the one its pointer for ``model`` and ``codec`` names,
    checked (:func:`load_stored_profile`); else ``local()``, and when the store has no pointer,
    that profile is published and adopted (unless another producer adopts one first: then
    that one is used; ``publish=False`` writes nothing). A refused or unreachable store's
    profile is no error: the choice says why, and the local profile is used without touching
    the pointer."""
    try:
        return _adopted(store, model, codec)
    except _NoPointer:
        pass
    except (ProfileRefused, StoreError) as exc:  # a damaged pointer is a ChunkCorrupt
        refused = f"{type(exc).__name__}: {exc}"
        if not publish or not isinstance(exc, (ProfileRefused, ChunkCorrupt)):
            return ProfileChoice(local(), "local", refused=refused)  # unreachable: no retries
        return _local(store, local(), refused)
    profile = local()
    if not publish:
        return ProfileChoice(profile, "local")
    try:
        publish_profile(store, profile)
        if store.adopt_profile(model.fingerprint, codec, profile.id, model.name):
            return ProfileChoice(profile, "local", adopted=True)
        return _adopted(store, model, codec)  # another producer came first
    except (_NoPointer, ProfileRefused, StoreError) as exc:
        return ProfileChoice(profile, "local", refused=f"{type(exc).__name__}: {exc}")


class _NoPointer(Exception):
    """The store has no pointer for the model and codec."""


def _adopted(store: ChunkStore, model: ModelIdentity, codec: str) -> ProfileChoice:
    profile_id = store.adopted_profile(model.fingerprint, codec)
    if profile_id is None:
        raise _NoPointer
    return ProfileChoice(load_stored_profile(store, profile_id, model), "store")


def _local(store: ChunkStore, profile: Profile, refused: str) -> ProfileChoice:
    """``profile`` chosen over the store's; published (document and tables, shown by
    ``cachegen store profiles``), the pointer left alone."""
    with contextlib.suppress(StoreError):
        publish_profile(store, profile)
    return ProfileChoice(profile, "local", refused=refused)


def describe_profiles(store: ChunkStore) -> dict:
    """What ``cachegen store profiles`` shows: every stored profile document (id, model,
    levels, default level, bytes, whether adopted, what is wrong with it) and every adopted
    pointer (model fingerprint, codec, profile id, what is wrong with it)."""
    adopted = []
    for fingerprint, codec in store.pointers():
        entry = {"fingerprint": fingerprint, "codec": codec, "profile": None, "error": None}
        try:
            entry["profile"] = store.adopted_profile(fingerprint, codec)
        except StoreError as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        adopted.append(entry)
    chosen = {a["profile"] for a in adopted}
    profiles = []
    for profile_id in store.profile_ids():
        entry = {"id": profile_id, "model": None, "levels": [], "default_level": None}
        entry.update(bytes=0, adopted=profile_id in chosen, error=None)
        try:
            data = store.get_profile(profile_id)
            if data is None:
                continue  # removed since it was listed
            profile = profile_from_document(data, f"{profile_id} in {store.label}")
            entry.update(
                model={"name": profile.model.name, "fingerprint": profile.model.fingerprint},
                levels=sorted(profile.levels),
                default_level=profile.default_level,
                bytes=len(data),
            )
        except (StoreError, CodecError) as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        profiles.append(entry)
    return {"profiles": profiles, "adopted": adopted}
