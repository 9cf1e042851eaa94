"""What the store holds of an engine's prompts: the lookups the scheduler plans loads and saves
with (``StoreIndex``), and the chunk keys both sides name records by (``KeyChain``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachegen.connector.codecs import CodecSet
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.connector.ladder import LevelPolicy
from cachegen.connector.parts import FULL, SLIDING, Plan, RecordParts
from cachegen.errors import CacheGenError
from cachegen.kv import ModelIdentity
from cachegen.models import ServedWeights
from cachegen.modes import Form
from cachegen.store import RecordAddress, chunk_keys, open_store, stored_prefix
from cachegen.store.url import without_password
from cachegen.stream import Option


def open_engine_store(config: ConnectorConfig) -> Any:
    """The engine's store, with its MAC secret (else ``$CACHEGEN_STORE_SECRET``, read by the
    store) and per-record cap; a store that cannot be opened stops the start."""
    options: dict[str, Any] = {}
    if config.store_secret:
        options["secret"] = config.store_secret
    if config.max_record_bytes is not None:
        options["max_record_bytes"] = config.max_record_bytes
    try:
        return open_store(config.store, **options)
    except CacheGenError as exc:
        shown = without_password(config.store)
        raise ConnectorError(f"cannot open the KV store {shown!r}: {exc}") from exc


@dataclass(frozen=True)
class KeyChain:
    """The chunk keys of prompts under each codec's profile (``cachegen.store.keys``), for the
    model ``identity`` served as ``weights``."""

    codecs: CodecSet
    identity: ModelIdentity
    chunk_tokens: int
    weights: ServedWeights

    def keys(self, codec: str, token_ids: Sequence[int], salt: str | None = None) -> list[str]:
        """Keys of the whole chunks of ``token_ids`` under ``codec``'s profile, in the key
        scope ``salt`` (a request's tenant and cache_salt, ``RequestOptions.salt``)."""
        profile = self.codecs.get(codec).profile_id
        return chunk_keys(
            self.identity,
            profile,
            list(token_ids),
            self.chunk_tokens,
            weights=self.weights,
            include_partial=False,
            salt=salt,
        )


class StoreIndex:
    """The scheduler's view of the store: which prefixes are stored, in which forms, and how
    large their records are."""

    def __init__(self, store: Any, keys: KeyChain, ladder: LevelPolicy, parts: RecordParts) -> None:
        self.store = store
        self.key_chain = keys
        self.ladder = ladder
        self.parts = parts
        self.chunk_tokens = parts.chunk_tokens

    def keys(self, codec: str, token_ids: Sequence[int], salt: str | None = None) -> list[str]:
        return self.key_chain.keys(codec, token_ids, salt)

    def stored_chunks(self, token_ids: Sequence[int], options: RequestOptions) -> int:
        """Leading whole chunks of ``token_ids`` stored in every part, loadable with ``options``."""
        keys = self.keys(self.ladder.lookup_codec(options), token_ids, options.salt)
        forms = self.ladder.load_forms(options)
        count = stored_prefix(self.store, [self._full_parts(k, forms) for k in keys])
        if self.parts.split and count:
            sliding = [[RecordAddress.of(k, f, SLIDING) for f in forms] for k in keys[:count]]
            count = stored_prefix(self.store, sliding)
        return count if count == 0 or self._decodable(forms) else 0

    def loadable_tokens(
        self,
        token_ids: Sequence[int],
        options: RequestOptions,
        begin: int = 0,
        limit: int | None = None,
    ) -> int:
        """End of the longest prefix of ``token_ids`` (at most ``limit``) whose tokens from
        ``begin`` on a load with ``options`` can fetch: the full-attention part of each of its
        chunks and, for a model with sliding-window layers, the sliding part of each chunk that
        load fetches (with ``skip_out_of_window``, only those within the window before its
        end). A prefix that ends inside a chunk is possible only through ``limit``."""
        keys = self.keys(self.ladder.lookup_codec(options), token_ids, options.salt)
        forms = self.ladder.load_forms(options)
        end = self._loadable_end(keys, forms, options, begin, limit)
        return end if end <= begin or self._decodable(forms) else begin

    def _decodable(self, forms: Sequence[Form]) -> bool:
        """Whether this engine can get what records in ``forms`` need to be decoded (a coded
        cachegen level's tables): a stored chunk it cannot decode is no hit."""
        return self.key_chain.codecs.undecodable(forms) is None

    def saved_chunks(
        self, token_ids: Sequence[int], modes: Sequence[str], salt: str | None = None
    ) -> int:
        """Leading whole chunks of ``token_ids`` that a load with the default request options
        finds in every form a save of ``modes`` writes (``LevelPolicy.stored_forms``), in the
        key scope ``salt``. For a model with sliding-window layers that is the full part of
        each chunk and the sliding part of those within the window before the prefix's end:
        vLLM's hybrid allocator frees the sliding blocks behind the window between the steps
        of a long prefill, so a save cannot write the sliding part of earlier chunks."""
        options = RequestOptions()
        counts = [
            self._loadable_end(self.keys(codec, token_ids, salt), forms, options)
            // self.chunk_tokens
            for codec, forms in self.ladder.stored_forms(modes).items()
        ]
        return min(counts, default=0)

    def sizes(self, records: Sequence[RecordAddress]) -> list[int | None]:
        """Payload bytes of each record (None: not stored)."""
        return self.store.payload_sizes(records)

    def stored_options(
        self, token_ids: Sequence[int], rows: Plan, salt: str | None
    ) -> list[Option]:
        """Every form the records of ``rows`` (``RecordParts.load_plan``) can be loaded in
        (``LevelPolicy.loadable_forms``: each cachegen level of its ladder, coded or packed,
        and every form the saves of ``save_modes`` write: tcq's levels and its ladder's fast
        form, raw, int8, fp8), under its own codec's keys, with the payload size of each
        record in it (None: not stored) and its quality loss (``LevelPolicy.form_loss_pct``)."""
        first_chunk, end_chunk = (rows[0][0], rows[-1][0] + 1) if rows else (0, 0)
        prefix = token_ids[: end_chunk * self.chunk_tokens]
        options = []
        for codec, forms in self.ladder.loadable_forms.items():
            keys = self.keys(codec, prefix, salt)[first_chunk:]
            for form in forms:
                records = self.parts.plan_records(keys, first_chunk, rows, form)
                loss = self.ladder.form_loss_pct.get(form.label)
                options.append(Option(form.label, records, self.sizes(records), loss))
        return options

    def _full_parts(self, key: str, forms: Sequence[Form]) -> list[RecordAddress]:
        """The records of chunk ``key`` a load always fetches: its full part (or the whole
        chunk) in each of ``forms``."""
        part = FULL if self.parts.split else None
        return [RecordAddress.of(key, form, part) for form in forms]

    def _loadable_end(
        self,
        keys: Sequence[str],
        forms: Sequence[Form],
        options: RequestOptions,
        begin: int = 0,
        limit: int | None = None,
    ) -> int:
        """:meth:`loadable_tokens` for the chunks of ``keys``, stored in every one of ``forms``."""
        C = self.chunk_tokens
        stored = stored_prefix(self.store, [self._full_parts(k, forms) for k in keys])
        end = stored * C if limit is None else min(stored * C, limit)
        if not self.parts.split or end <= begin:
            return end
        first, last = begin // C, -(-end // C)
        sliding = [RecordAddress.of(k, f, SLIDING) for k in keys[first:last] for f in forms]
        held = self.store.holds(sliding)
        present = [all(held[i * len(forms) : (i + 1) * len(forms)]) for i in range(last - first)]
        while end > begin:
            missing = [
                j
                for j in range(max(first, self.parts.sliding_from(end, options)), -(-end // C))
                if not present[j - first]
            ]
            if not missing:
                break
            end = min(missing) * C  # any shorter prefix still needing chunk j fails too
        return end
