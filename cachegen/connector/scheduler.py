"""Scheduler side of the connector: prefix lookup, load/save planning, per-request reports.

Runs inside vLLM's scheduler loop, so nothing here may raise into vLLM: a bad request option
or an unreachable store turns into "no hit" (vLLM computes the prompt) plus an ``error`` entry
in the request's output ``kv_transfer_params``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cachegen.connector.client_report import for_client
from cachegen.connector.codecs import codec_name
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.index import StoreIndex
from cachegen.connector.inputs import InputsRefused, request_inputs
from cachegen.connector.load_plan import LoadPlan
from cachegen.connector.lookup import Lookup, StoreQuestions
from cachegen.connector.metadata import LoadReports, LoadTask, SaveTask, StepMetadata
from cachegen.connector.paged_cache import CacheGroup, held_from
from cachegen.connector.pending_saves import PendingSave, PendingSaves
from cachegen.connector.stats import StatsRecorder
from cachegen.connector.store_guard import PendingAnswer, StoreGuard, StoreUnanswered
from cachegen.errors import CacheGenError
from cachegen.fileio import versioned
from cachegen.store.keys import key_scope

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

REPORT_KEY = "cachegen"  # output kv_transfer_params[REPORT_KEY] holds the connector's report
REPORT_SCHEMA = "cachegen-connector-report"
REPORT_VERSION = 2  # 2: per-chunk "forms" (was "levels"), "form_loss_pct" (was "forms")


@dataclass
class _Tracked:
    request: Request
    options: RequestOptions | None  # None: the connector neither loads nor saves it
    error: str | None = None
    fallback: str | None = None  # why it was (partly) recomputed instead of loaded (metrics)
    lookup: Lookup | None = None  # the store's answer to the newest lookup, when it comes
    saved: PendingAnswer[int] | None = None  # leading chunks of the prompt stored already
    load: LoadTask | None = None  # granted by vLLM, not yet sent to the workers
    loading: bool = False  # an asynchronous load is running on the workers
    load_failed: bool = False  # never retried: vLLM recomputes instead
    sliding_from: int = 0  # chunks before it hold no valid sliding-layer KV (a load skipped it)
    lossy: bool = False  # a load may give it KV of a lossy form: what it computes is not saved
    save_wait_since: float | None = None  # first held back for a save of this engine (monotonic)
    report: dict[str, Any] = field(default_factory=dict)


class SchedulerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        index: StoreIndex,
        block_size: int,
        role: str,
        groups: list[CacheGroup] | None = None,
    ) -> None:
        """``groups``: vLLM's KV cache groups (None: one group of ``block_size`` blocks)."""
        config.check_block_size(block_size)
        self.config = config
        self.index = index
        self.block_size = block_size
        self.groups = groups or [CacheGroup(None, block_size)]
        # With several KV cache groups vLLM recovers a failed load only for a request waiting
        # for its KV (block ids name no request there), so every load runs in the background.
        self.load_async = config.load_async or len(self.groups) > 1
        self.can_load = role in ("kv_consumer", "kv_both")
        self.can_save = role in ("kv_producer", "kv_both")
        self._tracked: dict[str, _Tracked] = {}
        self._save_ids = itertools.count(1)
        self.pending_saves = PendingSaves(config.chunk_tokens, config.save_wait_ms)
        self.stats = StatsRecorder()  # lookups and loads (the workers count saves)
        self.guard = StoreGuard(config.store_deadline_ms / 1000.0, config.store_backoff_s)
        self.questions = StoreQuestions(index, self.guard, config, block_size)

    # ---- lookup ------------------------------------------------------------------------------

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            try:
                options = self.config.request_options(request.kv_transfer_params)
                self.index.ladder.load_forms(options)  # a form the engine does not store
                salt = key_scope(
                    self.config.tenant,
                    getattr(request, "cache_salt", None),
                    request_inputs(request),
                )
                tracked = _Tracked(request, dataclasses.replace(options, salt=salt))
                if salt is not None:
                    tracked.report["salted"] = True
            except InputsRefused as exc:  # KV its keys cannot name
                logger.info("request %s: not loaded nor saved: %s", request.request_id, exc)
                tracked = _Tracked(request, None, error=str(exc), fallback=exc.reason)
            except (CacheGenError, TypeError, ValueError) as exc:  # bad options or cache_salt
                logger.warning(
                    "request %s: ignoring the cachegen connector: %s", request.request_id, exc
                )
                tracked = _Tracked(request, None, error=str(exc), fallback="bad_options")
            self._tracked[request.request_id] = tracked
        return tracked

    def num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        tracked = self._track(request)
        if (
            not self.can_load
            or tracked.options is None
            or not tracked.options.load
            or tracked.load_failed
        ):
            self._ask_saved(tracked)
            return 0, False
        codec = self.index.ladder.lookup_codec(tracked.options)
        if self.pending_saves.holds(tracked, codec, num_computed_tokens):
            return None, False  # vLLM asks again on a later step
        if tracked.lookup is None or tracked.lookup.computed != num_computed_tokens:
            prompt = list(tracked.request.prompt_token_ids or [])
            tracked.lookup = self.questions.lookup(prompt, tracked.options, num_computed_tokens)
        self._ask_saved(tracked)  # after the lookup, which probes a store counted down
        matched = self._matched(tracked, tracked.lookup)
        if matched is None:
            return None, False  # not answered yet: vLLM asks again on a later step
        return matched, matched > 0 and self.load_async

    def _ask_saved(self, tracked: _Tracked) -> None:
        """Ask, once, how much of the prompt is stored, for a request whose prompt is saved."""
        options = tracked.options
        if tracked.saved is not None or options is None or not options.save:
            return
        if self.can_save and self.config.save_modes:
            prompt = list(tracked.request.prompt_token_ids or [])
            tracked.saved = self.questions.saved_chunks(prompt, options.salt)

    def _matched(self, tracked: _Tracked, lookup: Lookup) -> int | None:
        try:
            return self.questions.matched(lookup)
        except StoreUnanswered as exc:
            logger.warning(
                "request %s: store lookup failed, computing instead: %s",
                tracked.request.request_id,
                exc,
            )
            tracked.error = f"lookup failed: {exc.reason}"
            tracked.fallback = exc.reason
            lookup.matched = 0
            return 0

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """A load of the tokens vLLM granted; one that fails at once when anything goes wrong
        here, since the request waits for its load to end."""
        if num_external_tokens <= 0:
            return
        try:
            self._after_alloc(request, blocks, num_external_tokens)
        except Exception as exc:  # noqa: BLE001 - the request must get its (failed) load
            logger.exception("request %s: planning its load failed", request.request_id)
            tracked = self._tracked.setdefault(request.request_id, _Tracked(request, None))
            tracked.fallback = "internal_error"
            begin = request.num_computed_tokens
            end = begin + num_external_tokens
            prompt = list(request.prompt_token_ids or [])
            plan = LoadPlan(prompt, begin, end, [], [], RequestOptions(), refused=str(exc))
            block_ids = [list(ids) for ids in blocks.get_block_ids()]
            tracked.load = LoadTask(request.request_id, block_ids, plan, self.load_async)

    def _after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracked = self._track(request)
        assert tracked.lookup is not None and tracked.options is not None
        begin = tracked.lookup.computed
        end = begin + num_external_tokens
        skipped_to = self.index.parts.sliding_from(end, tracked.options)
        if skipped_to > begin // self.config.chunk_tokens:
            tracked.sliding_from = max(tracked.sliding_from, skipped_to)
        plan = self._plan(tracked, list(request.prompt_token_ids), end)
        tracked.lossy |= plan.refused is None and not plan.lossless
        tracked.load = LoadTask(
            req_id=request.request_id,
            block_ids=[list(ids) for ids in blocks.get_block_ids()],
            plan=plan,
            in_background=self.load_async,
        )

    def _plan(self, tracked: _Tracked, prompt: list[int], end: int) -> LoadPlan:
        """The request's load plan; one refused, so that the request recomputes, when the
        store does not answer in time."""
        options, begin = tracked.options, tracked.lookup.computed
        try:
            return self.questions.load_plan(tracked.lookup, prompt, end, options)
        except StoreUnanswered as exc:
            logger.warning(
                "request %s: planning its load failed, computing instead: %s",
                tracked.request.request_id,
                exc,
            )
            tracked.fallback = exc.reason
            refused = f"planning failed: {exc.reason}"
            prefix = self.questions.prefix(prompt, end)
            return LoadPlan(prefix, begin, end, [], [], options, refused=refused)

    # ---- per-step metadata ----------------------------------------------------------------------

    def build_meta(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        meta = StepMetadata(step_tokens=scheduler_output.total_num_scheduled_tokens)
        for tracked in self._tracked.values():
            if tracked.load is not None:  # a load is issued once; a failure makes vLLM recompute
                meta.loads.append(tracked.load)
                plan = tracked.load.plan
                tracked.report["load_planned_tokens"] = plan.end - plan.begin
                tracked.loading = tracked.load.in_background
                tracked.load = None
        block_state = scheduler_output.kv_connector_block_state
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is not None and tracked.options is not None:
                save = self._contained_save(tracked, num_scheduled, block_state)
                if save is not None:
                    meta.saves.append(save)
        return meta

    def _contained_save(
        self, tracked: _Tracked, num_scheduled: int, block_state: Any
    ) -> SaveTask | None:
        """:meth:`_plan_save`, a failure of which skips the save (and nothing else)."""
        try:
            return self._plan_save(tracked, num_scheduled, block_state)
        except Exception:  # noqa: BLE001 - one request's save must not stop the others' loads
            logger.exception("request %s: planning its save failed", tracked.request.request_id)
            return self._skip_save(tracked, "internal_error")

    def _plan_save(
        self, tracked: _Tracked, num_scheduled: int, block_state: Any
    ) -> SaveTask | None:
        """A save when this step completes the prompt's prefill (so its KV is all in cache)."""
        request = tracked.request
        options = tracked.options
        if not self.can_save or options is None or not options.save or not self.config.save_modes:
            return None
        prompt = request.prompt_token_ids or []
        before = request.num_computed_tokens
        if not before < len(prompt) <= before + num_scheduled:
            return None
        full = len(prompt) // self.config.chunk_tokens * self.config.chunk_tokens
        if full == 0:
            return None
        if tracked.lossy:  # its KV after the loaded prefix was computed on a lossy form's KV
            return self._skip_save(tracked, "lossy_ancestry")
        try:
            stored = self.questions.stored_chunks(tracked.saved, tracked.load_failed)
        except StoreUnanswered as exc:
            logger.warning("request %s: store unavailable, not saving: %s", request.request_id, exc)
            return self._skip_save(tracked, exc.reason)
        if stored * self.config.chunk_tokens >= full:
            return None
        groups = block_state.get_block_ids(request.request_id) if block_state is not None else None
        if not groups:
            return None
        tracked.report["save_chunks"] = full // self.config.chunk_tokens - stored
        save_id = next(self._save_ids)
        self.pending_saves.add(
            save_id,
            PendingSave(
                list(prompt[:full]),
                frozenset(map(codec_name, self.config.save_modes)),
                stored,
                options.salt,
            ),
        )
        return SaveTask(
            request.request_id,
            list(prompt[:full]),
            [list(ids) for ids in groups],
            self.config.save_modes,
            first_chunk=stored,
            sliding_from=max(tracked.sliding_from, self._held_chunks(groups)),
            salt=options.salt,
            save_id=save_id,
        )

    def _skip_save(self, tracked: _Tracked, reason: str) -> None:
        """Store nothing of the request's prompt, for ``reason`` (a reason code)."""
        tracked.report["save_skipped"] = reason
        self.stats.count("saves_skipped", reason)

    def _held_chunks(self, block_ids: tuple[list[int], ...]) -> int:
        """The first chunk all of whose tokens every KV cache group keeps (vLLM's HMA frees a
        sliding-window group's blocks behind its window)."""
        C = self.config.chunk_tokens
        return max(
            -(-held_from(list(ids), group.block_size) // C)
            for ids, group in zip(block_ids, self.groups, strict=True)
        )

    # ---- worker feedback and completion ---------------------------------------------------------

    def on_worker_output(self, reports: LoadReports | None, finished_loading: set[str]) -> None:
        if reports is not None:
            for save_id in reports.saved:
                self.pending_saves.done(save_id)
            for req_id, report in reports.reports.items():
                tracked = self._tracked.get(req_id)
                if tracked is not None:
                    tracked.report.update(report)
                    tracked.load_failed |= "load_error" in report
        for req_id in finished_loading:
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.loading = False

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        # A background load still writing into the request's blocks keeps them until the
        # worker reports it finished (vLLM frees them then), whatever else fails here.
        try:
            report = self._final_report(tracked)
        except Exception:  # noqa: BLE001 - the blocks' fate must still reach vLLM
            logger.exception("request %s: its report failed", request.request_id)
            report = versioned(REPORT_SCHEMA, REPORT_VERSION, {"fallback": "internal_error"})
        shown = for_client(report, self.config.client_report)
        return tracked.loading, (None if shown is None else {REPORT_KEY: shown})

    def _final_report(self, tracked: _Tracked) -> dict[str, Any]:
        report = versioned(REPORT_SCHEMA, REPORT_VERSION, tracked.report)
        if tracked.options is not None:
            report.setdefault("mode", tracked.options.mode)
        if tracked.error:
            report["error"] = tracked.error
        if tracked.fallback:
            report["fallback"] = tracked.fallback
        count_finished(self.stats, tracked)
        return report

    def close(self) -> None:
        self.guard.close()


def count_finished(stats: StatsRecorder, tracked: _Tracked) -> None:
    """A finished request's part of the metrics (docs/connector.md, "Metrics")."""
    report = tracked.report
    fallback = tracked.fallback or ("load_failed" if "load_error" in report else None)
    if fallback is not None:
        stats.count("fallbacks", fallback)
    if tracked.lookup is None or tracked.options is None:
        return
    mode = tracked.options.mode
    stats.count("lookups", mode)
    loaded = report.get("loaded_tokens", 0)
    if loaded:
        stats.count("hits", mode)
        stats.count("hit_tokens", mode, loaded)
    if "load_s" in report:
        stats.count("loaded_bytes", mode, report.get("bytes", 0))
        stats.observe_load(mode, report["load_s"])
