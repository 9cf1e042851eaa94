"""The connector's codecs, and the coding tables they share with the store.

The codecs are made when the scheduler's connector starts (``CodecSet.resolve``), after vLLM's
worker start-up: the codec pulls in numba, and vLLM 0.32's CPU start-up crashes when llvmlite is
already loaded at its worker's start (see docs/connector.md, "Known issues"). A server never
fits or calibrates: a codec whose profile or model file is neither shipped, nor on this machine,
nor in the store is a ``ConnectorError`` naming the command that makes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from cachegen.connector.config import ConnectorConfig
from cachegen.connector.errors import ConnectorError
from cachegen.errors import CacheGenError
from cachegen.kv import KVCache, ModelIdentity
from cachegen.models import ModelSpec
from cachegen.modes import CODED, Form
from cachegen.store import ChunkCorrupt

logger = logging.getLogger(__name__)


def codec_name(mode: str) -> str:
    """The codec whose records ``mode`` loads: ``adaptive`` chooses among cachegen's levels."""
    return "cachegen" if mode == "adaptive" else mode


class CodecSet:
    """Each mode's codec, made once; while any exists the store is a provider of coding tables
    and model files (a profile's missing tables, and a tcq chunk's model file, come from it),
    and each codec's are published to the store before its first record, and put back when
    the store has lost them (:meth:`publish_tables`). Chunks whose tables this engine cannot
    get are no hit (:meth:`undecodable`)."""

    def __init__(
        self, store: Any, config: ConnectorConfig, spec: ModelSpec, identity: ModelIdentity
    ) -> None:
        self.store = store
        self.config = config
        self.spec = spec
        self.identity = identity
        self._codecs: dict[str, Any] = {}
        self._catalogs: dict[str, Any] = {}
        self._store_tables: Any = None  # the store as a table provider, once a codec is made
        self._published: set[str] = set()  # codecs whose tables are in the store
        self._warned: set[str] = set()  # why chunks are undecodable, as logged
        # Where the cachegen profile came from (ProfileChoice.to_dict), once its codec is made.
        self.profile_choice: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def get(self, mode: str) -> Any:
        """The codec of ``mode`` (made on first use)."""
        name = codec_name(mode)
        with self._lock:
            if name not in self._codecs:
                if self._store_tables is None:  # before the codec: a profile's missing tables
                    self._store_tables = _add_store_tables(self.store)  # come from the store
                self._codecs[name] = self._make(name)
            return self._codecs[name]

    def catalog(self, mode: str) -> Any:
        """The ``LevelCatalog`` of ``mode``'s codec for this model (made on first use): its
        levels' sizes, losses, default and ladders (``cachegen.codec.catalog``)."""
        name = codec_name(mode)
        codec = self.get(name)
        with self._lock:
            if name not in self._catalogs:
                from cachegen.codec.catalog import LevelCatalog  # the codec loads numba

                fingerprint, chunk_tokens = self.identity.fingerprint, self.config.chunk_tokens
                self._catalogs[name] = LevelCatalog(codec, fingerprint, chunk_tokens)
            return self._catalogs[name]

    def resolve(self, modes: Iterable[str]) -> None:
        """Make the codec of each of ``modes`` now: a missing profile or model file stops the
        engine's start-up, naming the command that makes it, instead of failing requests."""
        for mode in modes:
            try:
                self.get(mode)
            except CacheGenError as exc:
                raise ConnectorError(
                    f"the engine may serve mode {mode!r}, but its codec cannot be made: {exc}"
                ) from exc

    def _make(self, name: str) -> Any:
        """``name``'s codec; for ``cachegen`` with ``profile_source: store``, on the profile the
        store has adopted for this model (:func:`cachegen.store.tables.resolve_profile`), so
        that this engine's chunk keys are every other engine's of the store."""
        chunk_tokens = self.config.chunk_tokens
        if name != "cachegen" or self.config.profile_source != "store":
            return _get_codec(name, self.spec, chunk_tokens)
        choice = _resolve_profile(self.store, self.spec, self.identity)
        self.profile_choice = choice.to_dict()
        if choice.refused:
            logger.warning(
                "cachegen: using this machine's codec profile %s, not the store's (%s); chunks "
                "stored under the store's profile are not found and are recomputed",
                choice.profile.id,
                choice.refused,
            )
        return _cachegen_codec(choice.profile, chunk_tokens)

    def publish_tables(self, mode: str) -> None:
        """Put the tables of every level of ``mode``'s profile, or ``tcq``'s model file, into
        the store (before the transport's first record): a consumer without them then needs
        neither a copy nor a refit, which may differ on other hardware. Before each later
        record, one look (a round trip) finds whether the store lost any of them, or the
        profile document and pointer this engine adopted (evicted, deleted), and puts those
        back."""
        name = codec_name(mode)
        if name not in ("cachegen", "tcq"):
            return
        codec = self.get(name)
        if name not in self._published:
            if name == "tcq":
                _publish_model_file(self.store, codec.tcq)
            else:
                _publish_tables(self.store, list(codec.profile.tables_ids.values()))
            self._published.add(name)
            return
        adopted = self.profile_choice is not None and self.profile_choice["refused"] is None
        lost = _republish(self.store, codec, self.identity if adopted else None)
        if lost:
            logger.warning(
                "cachegen: the store %s had lost %s (evicted or deleted); stored again",
                self.store.label,
                ", ".join(lost),
            )

    def undecodable(self, forms: Sequence[Form]) -> str | None:
        """Why this engine cannot decode records in ``forms`` now (None: it can): the tables a
        coded cachegen level needs are neither in memory, nor in this machine's tables
        directory, nor in the store (which keeps them here once read). Logged once, until
        they are back."""
        levels = [f.level for f in forms if f.codec == "cachegen" and f.packing == CODED]
        if not levels:
            return None
        profile = self.get("cachegen").profile
        try:
            for level in levels:
                profile.tables(level)
        except CacheGenError as exc:
            reason = (
                f"chunks of cachegen level {level} are not counted as hits: {exc}. Tables a "
                "store lost (evicted or deleted) come back with a producer's next save that "
                "stores a chunk"
            )
            if reason not in self._warned:
                self._warned.add(reason)
                logger.warning("cachegen: %s", reason)
            return reason
        self._warned.clear()
        return None

    def close(self) -> None:
        if self._store_tables is not None:
            _remove_store_tables(self._store_tables)


def decode(blob: bytes, out_dtype: torch.dtype, expect: Any = None) -> KVCache:
    """``blob`` decoded; ``expect(header)`` refuses a header before anything is sized from it."""
    from cachegen.codec import decode

    return decode(blob, out_dtype=out_dtype, expect=expect)


def damaged(exc: BaseException) -> bool:
    """Whether ``exc`` means a stored chunk is damaged (as opposed to unreachable)."""
    from cachegen.codec import CodecError
    from cachegen.codec.coding.tables import TablesMissing, TablesRefused

    if isinstance(exc, (TablesRefused, TablesMissing)):  # model files' errors subclass them
        return False  # the chunk is sound; the tables or model file it names are refused or missing
    return isinstance(exc, (ChunkCorrupt, CodecError, ConnectorError))


def _get_codec(name: str, spec: ModelSpec, chunk_tokens: int) -> Any:
    from cachegen.profiles import codec_for

    return codec_for(name, spec, build=False, chunk_tokens=chunk_tokens)


def _resolve_profile(store: Any, spec: ModelSpec, identity: ModelIdentity) -> Any:
    from cachegen.codec import load_profile
    from cachegen.store.tables import resolve_profile

    return resolve_profile(store, identity, lambda: load_profile(spec))


def _cachegen_codec(profile: Any, chunk_tokens: int) -> Any:
    from cachegen.codec import get_codec

    return get_codec("cachegen", profile=profile, chunk_tokens=chunk_tokens)


def _add_store_tables(store: Any) -> Any:
    from cachegen.codec.coding.tables import add_provider
    from cachegen.store.tables import StoreTables

    provider = StoreTables(store)
    add_provider(provider)
    return provider


def _remove_store_tables(provider: Any) -> None:
    from cachegen.codec.coding.tables import remove_provider

    remove_provider(provider)


def _publish_tables(store: Any, tables_ids: list[str]) -> None:
    from cachegen.store.tables import publish_tables

    publish_tables(store, tables_ids)


def _publish_model_file(store: Any, model_file: Any) -> None:
    from cachegen.store.tables import publish_model_file

    publish_model_file(store, model_file)


def _republish(store: Any, codec: Any, adopted: ModelIdentity | None) -> list[str]:
    """What the store had lost of ``codec``'s tables (``adopted``: and of the profile this
    engine adopted for that model), now stored again."""
    from cachegen.store.tables import republish_model_file, republish_profile

    if codec.name == "tcq":
        return republish_model_file(store, codec.tcq)
    return republish_profile(store, codec.profile, adopted)
