"""The connector's one seam to the rest of the library: find, fetch and write KV chunks.

It composes the codec (``cachegen.codec``: chunk <-> bitstream, per quality level), the store
(``cachegen.store``: chained chunk keys, longest stored prefix, put/get) and the stream
(``cachegen.stream``: rate-limited transfer pipelined with decoding, adaptive level choice).
Modes map onto codecs: ``raw``, ``int8``, ``fp8``, ``cachegen`` and ``tcq`` are codecs of the
same names, ``adaptive`` streams the ``cachegen`` codec's levels under the adaptive controller
(``slo_ms``), or with ``max_loss_pct`` every stored form within that quality bound (each
cachegen level coded or packed, and every form the saves of ``save_modes`` write: tcq's levels
and its ladder's fast form, the baselines) under the fastest-form controller, informed by what
this transport's earlier loads measured of each form.

Its collaborators: ``codecs`` (each mode's codec and the tables it shares with the store),
``ladder`` (the levels stored and loaded), ``parts`` (the records of a chunk: one, or a
full-attention and a sliding-window part, ``cachegen.connector.parts``), ``history`` (what
earlier loads measured) and ``sources`` (where loads read the store: the store itself in a
server, ``cachegen.connector.sources``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachegen.connector.codecs import CodecSet, damaged, decode
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.connector.ladder import LevelPolicy
from cachegen.connector.load_control import (
    LoadControl,
    RecordCheck,
    adaptive_control,
    drop_damaged,
    fastest_control,
    over_load_cap,
    stats_report,
)
from cachegen.connector.load_history import LoadHistory
from cachegen.connector.parts import SLIDING, Plan, RecordParts
from cachegen.connector.save_plan import ModeLadder, SavePrefix, SaveRecord, plan_save
from cachegen.connector.sources import DirectSources, SourcePool
from cachegen.errors import CacheGenError, InputError
from cachegen.kv import KVCache, ModelIdentity
from cachegen.models import ModelSpec
from cachegen.modes import CODED, Form
from cachegen.store import chunk_keys, longest_prefix, open_store
from cachegen.store.url import without_password
from cachegen.stream import Option, stream_load

# The prefill rate a load's controller assumes before this engine has measured one.
DEFAULT_PREFILL_TOKENS_PER_S = 1000.0


@dataclass
class LoadResult:
    """Outcome of fetching chunks: the first ``chunks_loaded`` were injected, the rest were not.

    ``error`` says why the rest were not (a failure, or the adaptive controller choosing to
    recompute); the connector turns it into recomputation of those tokens.
    """

    chunks_loaded: int
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


def store_options(config: ConnectorConfig) -> dict[str, Any]:
    """``open_store`` keywords from the connector's options: the MAC secret and the per-record
    cap (the store reads ``$CACHEGEN_STORE_SECRET`` itself when no secret is configured)."""
    options: dict[str, Any] = {}
    if config.store_secret:
        options["secret"] = config.store_secret
    if config.max_record_bytes is not None:
        options["max_record_bytes"] = config.max_record_bytes
    return options


class ChunkTransport:
    """Finds, fetches and writes the chunks of prompts in the connector's store."""

    def __init__(
        self,
        config: ConnectorConfig,
        spec: ModelSpec,
        identity: ModelIdentity,
        sources: Callable[[Any], SourcePool] = DirectSources,  # where loads read the store
    ) -> None:
        self.config = config
        self.spec = spec
        self.identity = identity
        self.chunk_tokens = config.chunk_tokens
        try:
            self.store = open_store(config.store, **store_options(config))
        except CacheGenError as exc:
            shown = without_password(config.store)
            raise ConnectorError(f"cannot open the KV store {shown!r}: {exc}") from exc
        self.codecs = CodecSet(self.store, config, spec, identity)
        self.ladder = LevelPolicy(self.codecs, config, identity.fingerprint)
        self.parts = RecordParts.of(spec, self.chunk_tokens)
        self.history = LoadHistory(self.chunk_tokens)
        self.sources = sources(self.store)

    # ---- codecs, keys, levels -------------------------------------------------------------------

    def codec(self, mode: str) -> Any:
        return self.codecs.get(mode)

    @property
    def profile_choice(self) -> dict[str, Any] | None:
        """Where the cachegen profile came from (``ProfileChoice.to_dict``), once its codec
        is made."""
        return self.codecs.profile_choice

    def levels(self, mode: str) -> list[int]:
        return self.ladder.levels(mode)

    def load_levels(self, options: RequestOptions) -> list[int]:
        return self.ladder.load_levels(options)

    def sliding_from(self, end: int, options: RequestOptions) -> int:
        return self.parts.sliding_from(end, options)

    def keys(self, mode: str, token_ids: Sequence[int], salt: str | None = None) -> list[str]:
        """Keys of the whole chunks of ``token_ids`` under ``mode``'s codec profile, in the key
        scope ``salt`` (a request's tenant and cache_salt, ``RequestOptions.salt``)."""
        profile = self.codec(mode).profile_id
        return chunk_keys(
            self.identity,
            profile,
            list(token_ids),
            self.chunk_tokens,
            include_partial=False,
            salt=salt,
        )

    # ---- lookups -------------------------------------------------------------------------------

    def _longest(self, keys: Sequence[str], levels: Sequence[int]) -> int:
        """Leading chunks of ``keys`` with every part stored at every one of ``levels``."""
        count = longest_prefix(self.store, keys, levels)
        if self.parts.split and count:
            sliding = [self.parts.record_key(k, SLIDING) for k in keys[:count]]
            count = longest_prefix(self.store, sliding, levels)
        return count

    def stored_chunks(self, token_ids: Sequence[int], options: RequestOptions) -> int:
        """Leading whole chunks of ``token_ids`` stored in every part, loadable with ``options``."""
        keys = self.keys(self.ladder.lookup_codec(options), token_ids, options.salt)
        return self._longest(keys, self.load_levels(options))

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
        return _loadable_end(
            self.store, self.parts, keys, self.load_levels(options), options, begin, limit
        )

    def saved_chunks(
        self, token_ids: Sequence[int], modes: Sequence[str], salt: str | None = None
    ) -> int:
        """Leading whole chunks of ``token_ids`` that a load with the default request options
        finds in every form a save of ``modes`` writes (``LevelPolicy.stored_slots``), in the
        key scope ``salt``. For a model with sliding-window layers that is the full part of
        each chunk and the sliding part of those within the window before the prefix's end:
        vLLM's hybrid allocator frees the sliding blocks behind the window between the steps
        of a long prefill, so a save cannot write the sliding part of earlier chunks."""
        options = RequestOptions()
        counts = [
            _loadable_end(self.store, self.parts, self.keys(codec, token_ids, salt), slots, options)
            // self.chunk_tokens
            for codec, slots in self.ladder.stored_slots(modes).items()
        ]
        return min(counts, default=0)

    # ---- load ----------------------------------------------------------------------------------

    def load(
        self,
        token_ids: Sequence[int],
        first_chunk: int,
        num_chunks: int,
        options: RequestOptions,
        on_chunk: Callable[[KVCache], None],
        prefill_tokens_per_s: float | None = None,
        end: int | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> LoadResult:
        """Stream chunks ``first_chunk .. first_chunk + num_chunks - 1`` of ``token_ids``,
        decode them into ``out_dtype`` (the engine's KV dtype: a float32 engine's raw chunks
        load exactly) and hand each (in order) to ``on_chunk``: a whole chunk, or for a model
        with sliding-window layers each fetched part of it (a layer subset; the full-attention
        part first). ``end`` (default: the end of the last chunk) is where the loaded prefix
        ends; it decides which chunks' sliding parts are fetched."""
        keys = self._load_keys(token_ids, first_chunk, num_chunks, options)
        end = (first_chunk + num_chunks) * self.chunk_tokens if end is None else end
        plan = self.parts.load_plan(first_chunk, num_chunks, end, options)
        fetch = self.parts.plan_keys(keys, first_chunk, plan)
        prefill_tps = (
            self.config.prefill_tokens_per_s or prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
        )
        control = self._control(token_ids, plan, fetch, options, prefill_tps)
        if control.refused is not None:
            return LoadResult(0, control.refused, control.extra)
        consume = RecordCheck(plan, token_ids, self.identity, self.parts, on_chunk)
        try:
            source = self.sources.source(options)
            decoder = functools.partial(decode, out_dtype=out_dtype)
            stats = stream_load(source, fetch, decoder, consume, **control.stream_options())
        except CacheGenError as exc:
            return self._failed(exc, plan, fetch, control)
        self.history.learn(
            stats,
            self.ladder.lookup_codec(options),
            self.sources.link(options),
            self.sources.nominal_mbps(options),
        )
        error = None
        if stats.recompute_from is not None:
            error = (
                f"adaptive controller left chunks from {plan[stats.recompute_from][0]} "
                "on to recomputation"
            )
        return LoadResult(
            _chunks_done(plan, stats.n_loaded), error, self._report(stats, plan, control)
        )

    def _load_keys(
        self, token_ids: Sequence[int], first_chunk: int, num_chunks: int, options: RequestOptions
    ) -> list[str]:
        """The keys of chunks ``first_chunk ..`` (``num_chunks`` of them) of ``token_ids``."""
        prefix = token_ids[: (first_chunk + num_chunks) * self.chunk_tokens]
        keys = self.keys(self.ladder.lookup_codec(options), prefix, options.salt)[first_chunk:]
        if len(keys) != num_chunks:
            raise ConnectorError(
                f"{len(token_ids)} tokens do not hold chunks "
                f"{first_chunk}..{first_chunk + num_chunks - 1}"
            )
        return keys

    def _control(
        self,
        token_ids: Sequence[int],
        plan: Plan,
        fetch: list[str],
        options: RequestOptions,
        prefill_tps: float,
    ) -> LoadControl:
        """How a load of ``plan``'s records ``fetch`` streams: at the one level ``options``
        load, or under the controller of ``adaptive``; refused when no stored form is within
        ``max_loss_pct`` or the load would exceed ``max_load_bytes``."""
        initial_mbps = self.history.initial_mbps(
            self.sources.link(options), self.sources.nominal_mbps(options)
        )
        if options.mode == "adaptive" and options.max_loss_pct is not None:
            forms = self.stored_forms(token_ids, plan, options.salt)
            control = LoadControl(sizes={o.name: list(o.sizes) for o in forms})
            control.extra["forms"] = {o.name: o.loss_pct for o in forms}
            try:
                control.controller = fastest_control(
                    forms,
                    options,
                    self.chunk_tokens,
                    prefill_tps,
                    initial_mbps,
                    self.history.priors(),
                )
            except InputError as exc:  # no stored form within the bound
                control.refused = f"max_loss_pct={options.max_loss_pct}: {exc}"
                return control
        elif options.mode == "adaptive":
            sizes = {lv: self.store.sizes(fetch, lv) for lv in self.ladder.adaptive_levels}
            control = adaptive_control(
                sizes, len(fetch), options, self.chunk_tokens, prefill_tps, initial_mbps
            )
        else:
            control = LoadControl(level=self.load_levels(options)[0])
        sizes = control.sizes or {control.level: None}
        control.refused = over_load_cap(self.config.max_load_bytes, fetch, sizes, self.store.sizes)
        return control

    def _failed(
        self, exc: CacheGenError, plan: Plan, fetch: list[str], control: LoadControl
    ) -> LoadResult:
        """The result of a load that stopped on ``exc``, its damaged record deleted."""
        partial = getattr(exc, "stats", None)
        loaded = partial.n_loaded if partial else 0
        if damaged(exc) and partial is not None and loaded < len(fetch):
            drop_damaged(self.store, fetch, loaded, partial.levels[loaded], control.controller)
        report = self._report(partial, plan, control)
        return LoadResult(_chunks_done(plan, loaded), f"{type(exc).__name__}: {exc}", report)

    def _report(self, stats: Any, plan: Plan, control: LoadControl) -> dict[str, Any]:
        """The load's statistics, the control's extra entries and the controller's choices."""
        report = self.parts.report(stats_report(stats), stats, plan)
        return {**report, **control.extra, **control.decisions()}

    def stored_forms(self, token_ids: Sequence[int], plan: Plan, salt: str | None) -> list[Option]:
        """Every form the records of ``plan`` (``RecordParts.load_plan``) can be loaded in
        (``LevelPolicy.form_slots``: each cachegen level of its ladder, coded or packed, and
        every form the saves of ``save_modes`` write: tcq's levels and its ladder's fast form,
        raw, int8, fp8), under its own codec's keys, with the payload size of each record in it
        (None: not stored) and its quality loss (``LevelPolicy.form_loss_pct``)."""
        first_chunk, end_chunk = (plan[0][0], plan[-1][0] + 1) if plan else (0, 0)
        prefix = token_ids[: end_chunk * self.chunk_tokens]
        forms = []
        for codec, slots in self.ladder.form_slots.items():
            keys = self.keys(codec, prefix, salt)[first_chunk:]
            fetch = self.parts.plan_keys(keys, first_chunk, plan)
            for slot in slots:
                name = Form.from_slot(codec, slot).label
                sizes = self.store.sizes(fetch, slot)
                forms.append(Option(name, fetch, slot, sizes, self.ladder.form_loss_pct.get(name)))
        return forms

    # ---- save ----------------------------------------------------------------------------------

    def save_records(self, prefix: SavePrefix, kv: KVCache) -> list[SaveRecord]:
        """The records :meth:`save` writes of ``kv``, a chunk-aligned slice of the prompt of
        ``prefix``, in the order it writes them (``cachegen.connector.save_plan.plan_save``)."""
        first = kv.start // self.chunk_tokens
        tokens = prefix.token_ids[: kv.start + kv.num_tokens]
        firsts = self.ladder.first_slots(prefix.modes)
        ladders = [
            ModeLadder(
                codec, self.keys(codec, tokens, prefix.salt)[first:], slots, firsts.get(codec, [])
            )
            for codec, slots in self.ladder.stored_slots(prefix.modes).items()
        ]
        return plan_save(kv, ladders, self.parts, prefix.sliding_from)

    def write(self, record: SaveRecord) -> int:
        """Encode and store one record unless it is already stored (a level's packed form when
        ``record.level`` is its store slot); returns the bytes written."""
        if self.store.exists(record.key, record.level):
            return 0
        codec = self.codec(record.mode)
        form = Form.from_slot(record.mode, record.level)
        if form.packing == CODED:
            blob = codec.encode(record.kv, level=form.level)
        else:
            blob = codec.encode(record.kv, level=form.level, form=form.packing)
        self.codecs.publish_tables(record.mode)
        self.store.put(record.key, record.level, blob)
        return len(blob)

    def save(
        self,
        token_ids: Sequence[int],
        kv: KVCache,
        modes: Sequence[str],
        sliding_from: int = 0,
        salt: str | None = None,
    ) -> int:
        """Encode and store the whole chunks of ``kv``, a chunk-aligned slice of the prompt
        ``token_ids``, in every form a save of ``modes`` writes, in the key scope ``salt``;
        records already stored are skipped. The order is :meth:`save_records`'.
        For a model with sliding-window layers each chunk is two records
        (``RecordParts.part_keys``); chunks before chunk ``sliding_from`` get no sliding part
        (their sliding layers' KV in ``kv`` is not valid: a load skipped it). Returns the
        bytes written."""
        records = self.save_records(SavePrefix(token_ids, modes, sliding_from, salt), kv)
        return sum(self.write(record) for record in records)

    def close(self) -> None:
        self.sources.close()
        self.codecs.close()
        self.store.close()


def _loadable_end(
    store: Any,
    parts: RecordParts,
    keys: Sequence[str],
    levels: Sequence[int],
    options: RequestOptions,
    begin: int = 0,
    limit: int | None = None,
) -> int:
    """:meth:`ChunkTransport.loadable_tokens` for the chunks of ``keys`` in ``store``, stored
    at every one of ``levels``."""
    C = parts.chunk_tokens
    stored = longest_prefix(store, keys, levels)
    end = stored * C if limit is None else min(stored * C, limit)
    if not parts.split or end <= begin:
        return end
    first, last = begin // C, -(-end // C)
    present = [True] * (last - first)
    sliding = [parts.record_key(k, SLIDING) for k in keys[first:last]]
    for level in levels:
        present = [a and b for a, b in zip(present, store.exists_many(sliding, level))]
    while end > begin:
        missing = [
            j
            for j in range(max(first, parts.sliding_from(end, options)), -(-end // C))
            if not present[j - first]
        ]
        if not missing:
            break
        end = min(missing) * C  # any shorter prefix still needing chunk j fails too
    return end


def _chunks_done(plan: Plan, n_loaded: int) -> int:
    """Chunks of ``plan`` complete after its first ``n_loaded`` records."""
    if n_loaded >= len(plan):
        return len({chunk for chunk, _ in plan})
    return plan[n_loaded][0] - plan[0][0]
