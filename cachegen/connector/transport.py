"""The connector's one seam to the rest of the library: find, fetch and write KV chunks.

It composes the codec (``cachegen.codec``: chunk <-> bitstream, per quality level), the store
(``cachegen.store``: chained chunk keys, longest stored prefix, put/get) and the stream
(``cachegen.stream``: rate-limited transfer pipelined with decoding, adaptive level choice).
Modes map onto codecs: ``raw``, ``int8``, ``fp8`` and ``cachegen`` are codecs of the same
names, ``adaptive`` streams the ``cachegen`` codec's levels under the adaptive controller
(``slo_ms``), or with ``max_loss_pct`` every stored form within that quality bound (each
cachegen level coded or packed, and the other codecs of ``save_modes``) under the fastest-form
controller, informed by what this transport's earlier loads measured of each form.

A model that mixes full-attention and sliding-window layers (Gemma 3) stores each chunk as two
records (its *parts*): the full-attention layers under the chunk's key, the sliding layers
under ``cachegen.store.keys.sliding_key`` of it. A load of a prefix ending at token ``P``
fetches the sliding part only of the chunks that intersect ``[P - window, P)``
(``skip_out_of_window``, see :func:`window_chunks`); the sliding layers never read the other
chunks' keys. Models with one kind of layer keep one record per chunk under the chunk's key.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachegen.codec.form_loss import form_losses, form_name
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.errors import CacheGenError, InputError
from cachegen.kv import KVCache, ModelIdentity
from cachegen.models import ModelSpec, attention_windows
from cachegen.modes import KV_BASELINES, TCQ
from cachegen.store import ChunkCorrupt, chunk_keys, longest_prefix, open_store
from cachegen.store.keys import sliding_key
from cachegen.store.url import without_password
from cachegen.stream import (
    DECODE_EWMA,
    AdaptiveController,
    FastestController,
    Option,
    host_bound_mbps,
    open_link,
    stream_load,
)

logger = logging.getLogger(__name__)

# The codecs of save_modes whose stored records are forms of adaptive with max_loss_pct, beside
# cachegen's levels.
OTHER_FORMS = (*KV_BASELINES, TCQ)
# A measured goodput is remembered per link and becomes the controller's prior for the next load.
GOODPUT_EWMA = 0.5


def window_chunks(end: int, chunk_tokens: int, window: int) -> range:
    """Indices of the chunks (of ``chunk_tokens`` tokens) that intersect tokens
    ``[end - window, end)``: the only chunks whose keys a sliding-window layer of ``window``
    tokens reads when the prefix ``[0, end)`` is continued (from the token at ``end`` on)."""
    if end <= 0:
        return range(0)
    return range(max(0, end - window) // chunk_tokens, -(-end // chunk_tokens))


# A part of a chunk in a load plan: None (the whole chunk, one record), FULL or SLIDING.
FULL, SLIDING = "full", "sliding"


@dataclass(frozen=True, eq=False)
class SaveRecord:
    """One record a save writes: ``kv`` (a chunk, or one part of it) under ``key`` at
    ``level`` of ``mode``'s codec; ``first``: part of the save's first pass, after which the
    chunk is loadable (:meth:`ChunkTransport.first_levels`)."""

    mode: str
    key: str
    level: int
    kv: KVCache
    first: bool


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
    def __init__(self, config: ConnectorConfig, spec: ModelSpec, identity: ModelIdentity) -> None:
        self.config = config
        self.spec = spec
        self.identity = identity
        self.chunk_tokens = config.chunk_tokens
        try:
            self.store = open_store(config.store, **store_options(config))
        except CacheGenError as exc:
            shown = without_password(config.store)
            raise ConnectorError(f"cannot open the KV store {shown!r}: {exc}") from exc
        self._codecs: dict[str, Any] = {}
        self._store_tables: Any = None  # the store as a table provider, once a codec is loaded
        self._published: set[str] = set()  # codecs whose tables are in the store
        # Where the cachegen profile came from (ProfileChoice.to_dict), once its codec is made.
        self.profile_choice: dict[str, Any] | None = None
        self._links: dict[tuple[float | None, float], Any] = {}
        self._goodput_mbps: dict[tuple[float | None, float], float] = {}
        # Per form name (cachegen.codec.form_loss.form_name), from this transport's loads: the
        # decode seconds per token and the best goodput a host-bound load of it reached.
        self._decode_s_per_token: dict[str, float] = {}
        self._host_mbps: dict[str, float] = {}
        self._exits = contextlib.ExitStack()
        self._lock = threading.Lock()
        windows = attention_windows(spec.config)
        self.full_layers = tuple(i for i, w in enumerate(windows) if w is None)
        self.sliding_layers = tuple(i for i, w in enumerate(windows) if w is not None)
        # Two records per chunk only for models with both kinds of layers.
        self.split = bool(self.full_layers) and bool(self.sliding_layers)
        self.window = max((w for w in windows if w is not None), default=0)

    # ---- codecs, keys, levels -------------------------------------------------------------------

    def codec(self, mode: str) -> Any:
        name = "cachegen" if mode == "adaptive" else mode
        with self._lock:
            if name not in self._codecs:
                if self._store_tables is None:  # before the codec: a profile's missing tables
                    self._store_tables = _add_store_tables(self.store)  # come from the store
                self._codecs[name] = self._make_codec(name)
            return self._codecs[name]

    def _make_codec(self, name: str) -> Any:
        """``name``'s codec; for ``cachegen`` with ``profile_source: store``, on the profile the
        store has adopted for this model (:func:`cachegen.store.tables.resolve_profile`), so
        that this engine's chunk keys are every other engine's of the store."""
        if name != "cachegen" or self.config.profile_source != "store":
            return _get_codec(name, self.spec, self.chunk_tokens)
        choice = _resolve_profile(self.store, self.spec, self.identity)
        self.profile_choice = choice.to_dict()
        if choice.refused:
            logger.warning(
                "cachegen: using this machine's codec profile %s, not the store's (%s); chunks "
                "stored under the store's profile are not found and are recomputed",
                choice.profile.id,
                choice.refused,
            )
        return _cachegen_codec(choice.profile, self.chunk_tokens)

    def publish_tables(self, mode: str) -> None:
        """Put the tables of every level of ``mode``'s profile into the store (once per
        transport, before its first record): a consumer with the profile but not its tables
        then needs neither a copy nor a rebuild, which may differ on other hardware."""
        name = "cachegen" if mode == "adaptive" else mode
        if name != "cachegen" or name in self._published:
            return
        _publish_tables(self.store, list(self.codec(name).profile.tables_ids.values()))
        self._published.add(name)

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

    def levels(self, mode: str) -> list[int]:
        """The levels stored for ``mode``: ``cachegen_levels`` when set, else (``cachegen`` and
        ``adaptive``) the :attr:`default_ladder`; for ``tcq`` ``tcq_levels``, else its default
        level; the one level of the other codecs. A cachegen level's packed form is its record
        tag (``cachegen.codec.packed.record_tag``): a level with bit 15 set, stored and
        requested like a level."""
        codec = self.codec(mode)
        if mode == TCQ:
            chosen = self.config.tcq_levels or (codec.default_level,)
            unknown = sorted(set(chosen) - set(codec.levels))
            if unknown:
                raise ConnectorError(
                    f"tcq_levels {unknown} are not levels of this model's tcq model "
                    f"{list(codec.levels)}"
                )
            return list(dict.fromkeys(chosen))
        if mode not in ("cachegen", "adaptive"):
            return list(codec.levels)
        chosen = self.config.cachegen_levels
        if chosen is None:
            return list(self.default_ladder)
        unknown = sorted(lv for lv in set(chosen) if _tag_level(lv) not in codec.levels)
        if unknown:
            raise ConnectorError(
                f"cachegen_levels {unknown} are not levels of this model's profile "
                f"{list(codec.levels)} (nor their packed forms, level | 32768)"
            )
        if all(_tag_level(lv) != lv for lv in chosen):
            raise ConnectorError(
                f"cachegen_levels {list(chosen)} hold only packed forms; add a coded level "
                "(adaptive loads and ranks coded levels)"
            )
        return list(chosen)

    @functools.cached_property
    def default_ladder(self) -> list[int]:
        """The cachegen levels stored per chunk when ``cachegen_levels`` is not set: the codec's
        default level first, coded, then in its packed form (its record tag: loads that decode
        at memory speed) when both fit within half the raw bf16 KV. When ``adaptive`` is among
        the ``save_modes``, at most two cheaper levels follow, those :func:`storage_ladder`
        picks within half the raw KV beside the coded default alone (so ``adaptive`` has a
        ladder; its cost is documented per configuration in docs/connector.md). Levels are
        picked from the model's shipped calibrated levels when it has them, else from all.

        The controller ranks levels by their bytes, which only orders quality along a frontier:
        on SmolLM2 the paper's level 3 is slightly larger than calibrated level 4 at several
        times its perplexity change (docs/connector.md); the calibrated levels were each chosen
        for a measured perplexity target and together dominate the presets (docs/quality.md).
        Found once per transport: the scheduler asks on every lookup."""
        from cachegen.codec.packed import record_tag

        codec = self.codec("cachegen")
        pool = codec.profile.calibrated_levels() or list(codec.levels)
        default = codec.default_level
        bits = {lv: estimated_bits(codec, lv, self.chunk_tokens) for lv in {*pool, default}}
        budget = LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS
        cheaper = (
            storage_ladder(default, bits, budget)[1:]
            if "adaptive" in self.config.save_modes
            else []
        )
        packed = estimated_packed_bits(codec, default, self.chunk_tokens)
        if bits[default] + packed > budget:  # a default too large to store in both forms
            return [default, *cheaper]
        return [default, record_tag(default, "packed"), *cheaper]

    @functools.cached_property
    def adaptive_levels(self) -> list[int]:
        """The levels ``adaptive`` chooses from: the stored levels (``cachegen_levels`` when
        set, else the :attr:`default_ladder`) that are shipped calibrated levels, or every stored
        level when none is (the controller would trade a dominated preset for a few bytes). Coded
        forms only: the controller ranks levels by their bytes."""
        stored = [lv for lv in self.levels("adaptive") if _tag_level(lv) == lv]
        calibrated = set(self.codec("adaptive").profile.calibrated_levels())
        return [lv for lv in stored if lv in calibrated] or stored

    def first_levels(self, mode: str) -> list[int]:
        """The levels of ``mode`` a save writes first, for every chunk, before the others: those
        a request that names no level needs (the codec's default level, and the level that
        makes a chunk loadable for ``adaptive``), so the chunks become loadable soonest."""
        stored = self.levels(mode)
        needed = {self.codec(mode).default_level}
        if mode in ("cachegen", "adaptive"):
            needed.add(self.adaptive_levels[0])
        return [lv for lv in stored if lv in needed] or stored[:1]

    def load_levels(self, options: RequestOptions) -> list[int]:
        """Levels a chunk must be stored at to be loadable with ``options``: for ``adaptive``
        the first of :attr:`adaptive_levels` (written in a save's first pass); it chooses among
        the adaptive levels each chunk is stored at. ``options.level`` may name a stored level's
        packed form (its record tag, :meth:`levels`); the default level loads coded."""
        if options.mode == "adaptive":
            return self.adaptive_levels[:1]
        codec = self.codec(options.mode)
        level = codec.default_level if options.level is None else options.level
        if level not in self.levels(options.mode):
            raise ConnectorError(
                f"{options.mode} stores levels {self.levels(options.mode)}, not {level}"
            )
        return [level]

    def part_keys(self, key: str) -> list[str]:
        """Every record key of the chunk stored under ``key``: itself, and for a model with
        sliding-window and full-attention layers, its sliding part's key."""
        return [key, sliding_key(key)] if self.split else [key]

    def sliding_from(self, end: int, options: RequestOptions) -> int:
        """The first chunk whose sliding part a load of the prefix ``[0, end)`` fetches (0: the
        sliding part of every chunk, also for models without two kinds of layers)."""
        if not self.split or not options.skip_out_of_window:
            return 0
        return window_chunks(end, self.chunk_tokens, self.window).start

    def _longest(self, keys: Sequence[str], levels: Sequence[int]) -> int:
        """Leading chunks of ``keys`` with every part stored at every one of ``levels``."""
        count = longest_prefix(self.store, keys, levels)
        if self.split and count:
            count = longest_prefix(self.store, [sliding_key(k) for k in keys[:count]], levels)
        return count

    def stored_chunks(self, token_ids: Sequence[int], options: RequestOptions) -> int:
        """Leading whole chunks of ``token_ids`` stored in every part, loadable with ``options``."""
        return self._longest(
            self.keys(options.mode, token_ids, options.salt), self.load_levels(options)
        )

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
        C = self.chunk_tokens
        keys = self.keys(options.mode, token_ids, options.salt)
        levels = self.load_levels(options)
        stored = longest_prefix(self.store, keys, levels)
        end = stored * C if limit is None else min(stored * C, limit)
        if not self.split or end <= begin:
            return end
        first, last = begin // C, -(-end // C)
        present = [True] * (last - first)
        sliding = [sliding_key(k) for k in keys[first:last]]
        for level in levels:
            present = [a and b for a, b in zip(present, self.store.exists_many(sliding, level))]
        while end > begin:
            missing = [
                j
                for j in range(max(first, self.sliding_from(end, options)), -(-end // C))
                if not present[j - first]
            ]
            if not missing:
                break
            end = min(missing) * C  # any shorter prefix still needing chunk j fails too
        return end

    def saved_chunks(
        self, token_ids: Sequence[int], modes: Sequence[str], salt: str | None = None
    ) -> int:
        """Leading whole chunks of ``token_ids`` already stored, every part, at every level of
        every mode, in the key scope ``salt``."""
        counts = [self._longest(self.keys(m, token_ids, salt), self.levels(m)) for m in modes]
        return min(counts, default=0)

    # ---- load ----------------------------------------------------------------------------------

    def _link(self, options: RequestOptions) -> Any:
        """The link for ``options``' rate and RTT, started on first use and kept for the next
        loads: its chunk server is a child process (a remote machine's stand-in) whose start-up
        must not be charged to every load's TTFT."""
        key = (options.bandwidth_mbps, float(options.rtt_ms))
        with self._lock:
            if key not in self._links:
                if options.bandwidth_mbps is None and not options.rtt_ms:
                    link = open_link(self.store, shaper="none")
                else:
                    link = open_link(
                        self.store,
                        bandwidth_mbps=options.bandwidth_mbps,
                        rtt_ms=options.rtt_ms,
                        shaper=self.config.shaper,
                    )
                self._links[key] = self._exits.enter_context(link)
            return self._links[key]

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
        C = self.chunk_tokens
        keys = self.keys(options.mode, token_ids[: (first_chunk + num_chunks) * C], options.salt)[
            first_chunk:
        ]
        if len(keys) != num_chunks:
            raise ConnectorError(
                f"{len(token_ids)} tokens do not hold chunks "
                f"{first_chunk}..{first_chunk + num_chunks - 1}"
            )
        end = (first_chunk + num_chunks) * C if end is None else end
        plan = self.load_plan(first_chunk, num_chunks, end, options)
        fetch = _plan_keys(keys, first_chunk, plan)
        link_key = (options.bandwidth_mbps, float(options.rtt_ms))
        layers = {None: None, FULL: self.full_layers, SLIDING: self.sliding_layers}

        def consume(index: int, kv: KVCache) -> None:
            chunk, part = plan[index]
            start = chunk * C
            expected = torch.as_tensor(token_ids[start : start + C], dtype=torch.int64)
            if kv.start != start or not torch.equal(kv.token_ids, expected):
                raise ConnectorError(f"chunk {chunk} decodes to tokens of another prefix")
            if (kv.model.num_layers, kv.num_kv_heads, kv.head_dim) != (
                self.identity.num_layers,
                self.identity.num_kv_heads,
                self.identity.head_dim,
            ):
                raise ConnectorError(f"chunk {chunk} has the KV geometry of another model")
            if kv.layers != layers[part]:
                what = "all layers" if part is None else f"its {part} layers"
                raise ConnectorError(
                    f"chunk {chunk}: a record for {what} decodes to layers {list(kv.layer_indices)}"
                )
            on_chunk(kv)

        def result(n_loaded: int) -> int:
            """Chunks complete after the first ``n_loaded`` fetches."""
            return num_chunks if n_loaded >= len(plan) else plan[n_loaded][0] - first_chunk

        kwargs: dict[str, Any] = {}
        sizes: dict[Any, list[int | None]] | None = None
        prefill_tps = self.config.prefill_tokens_per_s or prefill_tokens_per_s or 1000.0
        initial_mbps = self._goodput_mbps.get(link_key, options.bandwidth_mbps)
        extra: dict[str, Any] = {}  # the report's entries beyond the load's statistics
        if options.mode == "adaptive" and options.max_loss_pct is not None:
            forms = self.stored_forms(token_ids, first_chunk, num_chunks, plan, options.salt)
            extra["forms"] = {o.name: o.loss_pct for o in forms}
            sizes = {o.name: list(o.sizes) for o in forms}
            try:
                kwargs["controller"] = self._fastest(forms, options, prefill_tps, initial_mbps)
            except InputError as exc:  # no stored form within the bound
                return LoadResult(0, f"max_loss_pct={options.max_loss_pct}: {exc}", extra)
        elif options.mode == "adaptive":
            assert options.slo_ms is not None
            # None where a chunk is not (yet) stored at a level: the controller skips it there.
            sizes = {lv: self.store.sizes(fetch, lv) for lv in self.adaptive_levels}
            kwargs["controller"] = AdaptiveController(
                options.slo_ms / 1000.0,
                sizes,
                [C] * len(fetch),
                prefill_tokens_per_s=prefill_tps,
                initial_mbps=initial_mbps,
            )
        else:
            kwargs["level"] = self.load_levels(options)[0]
        too_much = self._over_load_cap(fetch, sizes or {kwargs["level"]: None})
        if too_much is not None:
            return LoadResult(0, too_much, extra)
        controller = kwargs.get("controller")
        try:
            decode = functools.partial(_decode, out_dtype=out_dtype)
            stats = stream_load(self._link(options).source, fetch, decode, consume, **kwargs)
        except CacheGenError as exc:
            partial = getattr(exc, "stats", None)
            loaded = partial.n_loaded if partial else 0
            if _damaged(exc) and partial is not None and loaded < len(fetch):
                choice = partial.levels[loaded]
                if isinstance(controller, FastestController) and choice in controller.options:
                    self._drop(*controller.record(loaded, choice, fetch[loaded]))
                else:
                    self._drop(fetch[loaded], choice)
            report = {**self._report(partial, plan), **extra, **_decisions(controller)}
            return LoadResult(result(loaded), f"{type(exc).__name__}: {exc}", report)
        self._learn(stats, "cachegen" if options.mode == "adaptive" else options.mode, options)
        if stats.transfer_s > 0 and stats.bytes:
            previous = self._goodput_mbps.get(link_key)
            now = stats.goodput_mbps
            self._goodput_mbps[link_key] = (
                now if previous is None else (1 - GOODPUT_EWMA) * previous + GOODPUT_EWMA * now
            )
        error = None
        if stats.recompute_from is not None:
            error = (
                f"adaptive controller left chunks from {plan[stats.recompute_from][0]} "
                "on to recomputation"
            )
        report = {**self._report(stats, plan), **extra, **_decisions(controller)}
        return LoadResult(result(stats.n_loaded), error, report)

    def stored_forms(
        self,
        token_ids: Sequence[int],
        first_chunk: int,
        num_chunks: int,
        plan: Sequence[tuple[int, str | None]],
        salt: str | None,
    ) -> list[Option]:
        """Every form the records of ``plan`` (:meth:`load_plan`) can be loaded in: each stored
        cachegen level, coded or packed, each stored tcq level, and each other codec of
        ``save_modes`` (raw, int8, fp8), under its own keys, with the payload size of each
        record in it (None: not stored) and its quality loss (:attr:`form_loss_pct`)."""
        C = self.chunk_tokens
        prefix = token_ids[: (first_chunk + num_chunks) * C]
        codecs = ["cachegen", *(m for m in self.config.save_modes if m in OTHER_FORMS)]
        forms = []
        for codec in dict.fromkeys(codecs):
            fetch = _plan_keys(self.keys(codec, prefix, salt)[first_chunk:], first_chunk, plan)
            for slot in self.levels(codec):
                name = form_name(codec, slot)
                sizes = self.store.sizes(fetch, slot)
                forms.append(Option(name, fetch, slot, sizes, self.form_loss_pct.get(name)))
        return forms

    @functools.cached_property
    def form_loss_pct(self) -> dict[str, float | None]:
        """The quality loss (perplexity change, %; None: unknown) of each form this transport
        stores (``cachegen.codec.form_loss``)."""
        names = [form_name("cachegen", lv) for lv in self.levels("cachegen")]
        names += [m for m in self.config.save_modes if m in KV_BASELINES]
        tcq_targets = None
        if TCQ in self.config.save_modes:
            names += [form_name(TCQ, lv) for lv in self.levels(TCQ)]
            calibration = self.codec(TCQ).calibrated_levels()
            tcq_targets = calibration["targets"] if calibration else None
        calibrated = self.codec("cachegen").profile.calibrated_levels()
        return form_losses(names, self.identity.fingerprint, calibrated, tcq_targets)

    def _fastest(
        self,
        forms: list[Option],
        options: RequestOptions,
        prefill_tps: float,
        initial_mbps: float | None,
    ) -> FastestController:
        """The controller of an ``adaptive`` load under ``max_loss_pct``, with what this
        transport's earlier loads taught about each form (:meth:`_learn`)."""
        assert options.max_loss_pct is not None
        with self._lock:
            decode_s_per_token = dict(self._decode_s_per_token)
            host_mbps = dict(self._host_mbps)
        return FastestController(
            forms,
            [self.chunk_tokens] * len(forms[0].keys),
            max_loss_pct=float(options.max_loss_pct),
            prefill_tokens_per_s=prefill_tps,
            initial_mbps=initial_mbps,
            decode_s_per_token=decode_s_per_token,
            host_mbps=host_mbps,
        )

    def _learn(self, stats: Any, codec: str, options: RequestOptions) -> None:
        """Remember, per form, what a finished load of ``codec``'s records measured: its
        decode seconds per token (this load's median per record, averaged over loads), and
        its goodput over the whole load when it loaded every record in that one form and
        was bounded by the host, not the link (``cachegen.stream.host_bound_mbps``;
        the best such goodput is the form's ceiling on this host)."""
        per_form: dict[str, list[float]] = {}
        for chunk in stats.chunks:
            choice = stats.levels[chunk.index]
            name = choice if isinstance(choice, str) else form_name(codec, choice)
            per_form.setdefault(name, []).append(chunk.decode_s / self.chunk_tokens)
        with self._lock:
            for name, samples in per_form.items():
                now = statistics.median(samples)
                before = self._decode_s_per_token.get(name)
                self._decode_s_per_token[name] = (
                    now if before is None else (1 - DECODE_EWMA) * before + DECODE_EWMA * now
                )
            ceiling = host_bound_mbps(stats.bytes, stats.load_s, options.bandwidth_mbps)
            if len(per_form) == 1 and ceiling is not None:
                (name,) = per_form
                self._host_mbps[name] = max(self._host_mbps.get(name, 0.0), ceiling)

    def _over_load_cap(
        self, fetch: Sequence[str], sizes: dict[int, list[int | None] | None]
    ) -> str | None:
        """Why a load of ``fetch`` at one of the levels of ``sizes`` (payload bytes per record,
        looked up when None) may not start under ``max_load_bytes`` (None: it may). An adaptive
        load is held to its cheapest level per record."""
        cap = self.config.max_load_bytes
        if cap is None:
            return None
        per_level = [
            self.store.sizes(fetch, lv) if known is None else known for lv, known in sizes.items()
        ]
        need = sum(
            min((s for s in record if s is not None), default=0) for record in zip(*per_level)
        )
        if need <= cap:
            return None
        return (
            f"the load needs {need} bytes, more than max_load_bytes={cap}; "
            "recomputing instead (raise max_load_bytes to load prefixes this long)"
        )

    def load_plan(
        self, first_chunk: int, num_chunks: int, end: int, options: RequestOptions
    ) -> list[tuple[int, str | None]]:
        """The records a load fetches, in order: ``(chunk index, part)`` with part ``None``
        (the whole chunk) for a model with one kind of layer, else ``FULL`` for every chunk
        and ``SLIDING`` (right after it) for the chunks from :meth:`sliding_from` on."""
        chunks = range(first_chunk, first_chunk + num_chunks)
        if not self.split:
            return [(c, None) for c in chunks]
        sliding_from = self.sliding_from(end, options)
        plan: list[tuple[int, str | None]] = []
        for c in chunks:
            plan.append((c, FULL))
            if c >= sliding_from:
                plan.append((c, SLIDING))
        return plan

    def _report(self, stats: Any, plan: list[tuple[int, str | None]]) -> dict[str, Any]:
        """The load's statistics; ``bytes`` counts every record fetched, ``levels`` has one
        entry per chunk (its full part's level, or what stopped one of its parts)."""
        report = _report(stats)
        if not report or not self.split:
            return report
        per_chunk: dict[int, list[Any]] = {}
        for (chunk, _part), level in zip(plan, stats.levels):
            per_chunk.setdefault(chunk, []).append(level)
        levels = []
        for chunk in sorted(per_chunk):
            stopped = [x for x in per_chunk[chunk] if not isinstance(x, int)]
            levels.append(stopped[0] if stopped else per_chunk[chunk][0])
        report["levels"] = levels
        report["window_skipped_chunks"] = len(per_chunk) - sum(p == SLIDING for _, p in plan)
        report["sliding_bytes"] = sum(
            c.bytes
            for c in stats.chunks
            if 0 <= c.index < len(plan) and plan[c.index][1] == SLIDING
        )
        return report

    def _drop(self, key: str, level: Any) -> None:
        """Delete a damaged chunk so that the recomputation that follows stores it afresh."""
        if not isinstance(level, int):
            return
        try:
            self.store.delete(key, level)
        except CacheGenError:
            pass  # the store is failing anyway; the entry stays damaged and keeps being recomputed

    # ---- save ----------------------------------------------------------------------------------

    def save_records(
        self,
        token_ids: Sequence[int],
        kv: KVCache,
        modes: Sequence[str],
        sliding_from: int = 0,
        salt: str | None = None,
    ) -> list[SaveRecord]:
        """The records :meth:`save` writes, in the order it writes them: first the
        :meth:`first_levels` of every mode for each chunk in prefix order (a chunk is loadable
        once they are stored, and a repeat of the prompt needs the leading chunks first), then
        the other levels, again in prefix order."""
        C = self.chunk_tokens
        first = kv.start // C
        prefix = token_ids[: kv.start + kv.num_tokens]
        codecs = list(dict.fromkeys("cachegen" if m == "adaptive" else m for m in modes))
        keys = {m: self.keys(m, prefix, salt)[first:] for m in codecs}
        firsts = {m: self.first_levels(m) for m in codecs}
        ladders = {m: self.levels(m) for m in codecs}
        passes: tuple[list[SaveRecord], list[SaveRecord]] = ([], [])
        for at, chunk in enumerate(kv.chunks(C)):
            parts = [(False, chunk)]
            if self.split:
                parts = [(False, chunk.select_layers(self.full_layers))]
                if first + at >= sliding_from:
                    parts.append((True, chunk.select_layers(self.sliding_layers)))
            for mode in codecs:
                for sliding, part in parts:
                    key = sliding_key(keys[mode][at]) if sliding else keys[mode][at]
                    for level in ladders[mode]:
                        is_first = level in firsts[mode]
                        passes[not is_first].append(SaveRecord(mode, key, level, part, is_first))
        return passes[0] + passes[1]

    def write(self, record: SaveRecord) -> int:
        """Encode and store one record unless it is already stored (a level's packed form when
        ``record.level`` is its record tag); returns the bytes written."""
        if self.store.exists(record.key, record.level):
            return 0
        codec = self.codec(record.mode)
        level = _tag_level(record.level)
        if level == record.level:
            blob = codec.encode(record.kv, level=level)
        else:
            blob = codec.encode(record.kv, level=level, form="packed")
        self.publish_tables(record.mode)
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
        ``token_ids``, at every level of every mode, in the key scope ``salt``; records already
        stored are skipped. The order is :meth:`save_records`'.
        For a model with sliding-window layers each chunk is two records (:meth:`part_keys`);
        chunks before chunk ``sliding_from`` get no sliding part (their sliding layers' KV in
        ``kv`` is not valid: a load skipped it). Returns the bytes written."""
        records = self.save_records(token_ids, kv, modes, sliding_from, salt)
        return sum(self.write(record) for record in records)

    def close(self) -> None:
        self._exits.close()
        if self._store_tables is not None:
            _remove_store_tables(self._store_tables)
        self.store.close()


# ---- the default save ladder --------------------------------------------------------------------
# Sum of the ladder's estimated bits/element: half of bf16's 16 bits, less headroom for what the
# estimate leaves out (headers, frame token ids); the tables' estimate runs above real KV's
# payload for the shipped defaults (docs/connector.md, "Storage cost").
LADDER_BUDGET_BITS = 8.0
LADDER_HEADROOM_BITS = 0.05
LADDER_EXTRA_LEVELS = 2


def storage_ladder(
    default: int,
    bits: dict[int, float],
    budget: float = LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS,
) -> list[int]:
    """The levels to store per chunk: ``default`` first, then up to two levels of ``bits``
    (estimated bits/element per level) cheaper than it, while the sum stays within ``budget``:
    the cheapest level (the form for the slowest links), then the level nearest the midpoint
    between it and the default that still fits. Deterministic: ties go to the lower level."""
    ladder = [default]
    left = budget - bits[default]
    cheaper = sorted((b, lv) for lv, b in bits.items() if lv != default and b < bits[default])
    if not cheaper or cheaper[0][0] > left:
        return ladder
    low_bits, low = cheaper[0]
    ladder.append(low)
    left -= low_bits
    middle = (bits[default] + low_bits) / 2
    between = sorted((abs(b - middle), lv, b) for b, lv in cheaper[1:])
    for _, lv, b in between:
        if len(ladder) == 1 + LADDER_EXTRA_LEVELS:
            break
        if b <= left:
            ladder.append(lv)
            left -= b
    return ladder


def estimated_bits(codec: Any, level: int, chunk_tokens: int) -> float:
    """Bits/element of ``codec`` (cachegen) at ``level`` for a chunk of ``chunk_tokens`` tokens,
    from the level's coding tables alone: each table row's entropy (the code length its rANS
    tables give symbols drawn from the calibration's distribution) times the tokens it codes,
    plus the fp16 scales and the exactly stored tokens. Within ~0.2 bits of the calibration's
    own estimates ("est. X bits/element" in cachegen/codec/calibrated) and of measured streams;
    a property of the profile, not of any KV, so the ladder is the same on every engine."""
    import numpy as np

    from cachegen.codec.quant import exact_count, num_scales, segment_tokens

    tables = codec.profile.tables(level)
    config, model = tables.config, tables.model
    freq = tables.freq.astype(np.float64)
    p = freq / freq.sum(axis=1, keepdims=True)
    logs = np.log2(np.where(p > 0, p, 1.0))
    entropy = -(p * logs).sum(axis=1).reshape(model.num_layers, 2, tables.num_segments, -1)
    tokens = [len(t) for t in segment_tokens(chunk_tokens, config.group_size)]
    L, H, D = model.num_layers, model.num_kv_heads, model.head_dim
    bits = sum(float(entropy[:, :, s].sum()) * n for s, n in enumerate(tokens))
    bits += 16 * sum(num_scales(config.scale(k), L, H, n, D) for k in ("k", "v") for n in tokens)
    elements = 2 * L * H * D * chunk_tokens
    exact = exact_count(config, 0, chunk_tokens) * 2 * L * H * D
    bits += exact * (16 - float(entropy.mean()))  # the first chunk's exact tokens, bf16
    return bits / elements


def estimated_packed_bits(codec: Any, level: int, chunk_tokens: int) -> float:
    """Bits/element of ``codec`` (cachegen) at ``level`` in its packed form for a chunk of
    ``chunk_tokens`` tokens: each (layer, K/V)'s symbol width (the fewest bits that hold its
    alphabet), plus the fp16 scales and the first chunk's exactly stored tokens in bf16, all
    as the packed form stores them; exact up to the frame's header and token ids."""
    from cachegen.codec.packed import symbol_width
    from cachegen.codec.quant import exact_count, num_scales

    config, model = codec.profile.config(level), codec.profile.model
    L, H, D = model.num_layers, model.num_kv_heads, model.head_dim
    elements = 2 * L * H * D * chunk_tokens
    widths = sum(symbol_width(b) for kind in ("k", "v") for b in config.bins(kind))
    bits = widths * H * D * chunk_tokens
    bits += 16 * sum(num_scales(config.scale(k), L, H, chunk_tokens, D) for k in ("k", "v"))
    bits += 16 * exact_count(config, 0, chunk_tokens) * 2 * L * H * D
    return bits / elements


def _plan_keys(
    keys: Sequence[str], first_chunk: int, plan: Sequence[tuple[int, str | None]]
) -> list[str]:
    """The record keys of ``plan`` (:meth:`ChunkTransport.load_plan`), from the keys of its
    chunks (``keys[0]``: chunk ``first_chunk``'s)."""
    return [
        sliding_key(keys[c - first_chunk]) if part == SLIDING else keys[c - first_chunk]
        for c, part in plan
    ]


def _decisions(controller: Any) -> dict[str, Any]:
    """A load controller's choices for the report: per record fetched, its ``choice`` (a
    level, a form name, or ``recompute``) and ``predicted_s`` (None before any measurement)."""
    if controller is None:
        return {}
    decisions = []
    for decision in controller.decisions:
        entry = decision.to_dict()
        if entry["predicted_s"] != entry["predicted_s"]:  # NaN: chosen before any measurement
            entry["predicted_s"] = None
        decisions.append(entry)
    return {"decisions": decisions}


def _tag_level(level: int) -> int:
    """The level a stored level names: itself, or the level whose packed form it tags."""
    from cachegen.codec.packed import split_record_tag

    return split_record_tag(level)[0]


def _report(stats: Any) -> dict[str, Any]:
    if stats is None:
        return {}
    return {
        "bytes": stats.bytes,
        "levels": list(stats.levels),
        "transfer_s": stats.transfer_s,
        "decode_s": stats.decode_s,
        "inject_s": stats.consume_s,
        "wait_bytes_s": stats.wait_bytes_s,
        "goodput_mbps": stats.goodput_mbps,
    }


# ---- the codec ---------------------------------------------------------------------------------
# Imported on first use, never at start-up: the codec pulls in numba, and vLLM 0.32's CPU
# start-up crashes when llvmlite is already loaded (see docs/connector.md, "Known issues").


def _get_codec(name: str, spec: ModelSpec, chunk_tokens: int) -> Any:
    from cachegen.profiles import codec_for

    return codec_for(name, spec, chunk_tokens=chunk_tokens)


def _resolve_profile(store: Any, spec: ModelSpec, identity: ModelIdentity) -> Any:
    from cachegen.profiles import ensure_profile
    from cachegen.store.tables import resolve_profile

    return resolve_profile(store, identity, lambda: ensure_profile(spec))


def _cachegen_codec(profile: Any, chunk_tokens: int) -> Any:
    from cachegen.codec import get_codec

    return get_codec("cachegen", profile=profile, chunk_tokens=chunk_tokens)


def _add_store_tables(store: Any) -> Any:
    from cachegen.codec.tables import add_provider
    from cachegen.store.tables import StoreTables

    provider = StoreTables(store)
    add_provider(provider)
    return provider


def _remove_store_tables(provider: Any) -> None:
    from cachegen.codec.tables import remove_provider

    remove_provider(provider)


def _publish_tables(store: Any, tables_ids: list[str]) -> None:
    from cachegen.store.tables import publish_tables

    publish_tables(store, tables_ids)


def _decode(blob: bytes, out_dtype: torch.dtype) -> KVCache:
    from cachegen.codec import decode

    return decode(blob, out_dtype=out_dtype)


def _damaged(exc: BaseException) -> bool:
    """Whether ``exc`` means a stored chunk is damaged (as opposed to unreachable)."""
    from cachegen.codec import CodecError
    from cachegen.codec.tables import TablesRefused

    if isinstance(exc, TablesRefused):
        return False  # the chunk is sound; the tables it names are not
    return isinstance(exc, (ChunkCorrupt, CodecError, ConnectorError))
