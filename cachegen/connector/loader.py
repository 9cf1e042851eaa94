"""The worker's loads: a request's ``LoadPlan`` run as one pipeline, fetch -> decode -> check ->
inject, and what finished loads taught about links and forms (``LoadHistory``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cachegen.connector.codecs import damaged, decode
from cachegen.connector.load_control import (
    RecordCheck,
    controller_of,
    decisions,
    drop_damaged,
    stats_report,
)
from cachegen.connector.load_history import LoadHistory
from cachegen.connector.load_plan import LoadPlan
from cachegen.connector.parts import RecordParts
from cachegen.connector.sources import SourcePool
from cachegen.errors import CacheGenError
from cachegen.kv import KVCache, ModelIdentity
from cachegen.stream import stream_load

# The prefill rate a load's controller assumes before this engine has measured one.
DEFAULT_PREFILL_TOKENS_PER_S = 1000.0


@dataclass
class LoadResult:
    """Outcome of a load: the first ``chunks_loaded`` chunks were injected, the rest were not.

    ``error`` says why the rest were not (a failure, a refused plan, or the adaptive controller
    choosing to recompute); the connector turns it into recomputation of those tokens.
    """

    chunks_loaded: int
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


class Loader:
    """Runs load plans against ``store`` read through ``sources`` (where loads read it)."""

    def __init__(
        self,
        store: Any,
        sources: SourcePool,
        parts: RecordParts,
        identity: ModelIdentity,
        prefill_tokens_per_s: float | None = None,  # the engine's configured rate, if any
        timeout_s: float | None = None,  # the longest one load may take
    ) -> None:
        self.store = store
        self.sources = sources
        self.parts = parts
        self.identity = identity
        self.configured_prefill_tps = prefill_tokens_per_s
        self.timeout_s = timeout_s
        self.history = LoadHistory(parts.chunk_tokens)

    def run(
        self,
        plan: LoadPlan,
        inject: Callable[[KVCache], None],
        prefill_tokens_per_s: float | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> LoadResult:
        """Fetch ``plan``'s records, decode each into ``out_dtype`` (the engine's KV dtype: a
        float32 engine's raw chunks load exactly), check it is the record planned and hand it
        to ``inject`` in order: a whole chunk, or for a model with sliding-window layers each
        fetched part of it (a layer subset; the full-attention part first)."""
        if plan.refused is not None:
            return LoadResult(0, plan.refused, dict(plan.extra))
        link, nominal = self.sources.link(plan.options), self.sources.nominal_mbps(plan.options)
        prefill_tps = (
            self.configured_prefill_tps or prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
        )
        controller = controller_of(
            plan,
            self.parts.chunk_tokens,
            prefill_tps,
            self.history.initial_mbps(link, nominal),
            self.history.priors(),
        )
        check = RecordCheck(plan.rows, plan.token_ids, self.identity, self.parts, inject)
        try:
            stats = stream_load(
                self.sources.source(plan.options),
                plan.records,
                lambda blob: decode(blob, out_dtype, check.expect),
                check,
                controller=controller,
                timeout_s=self.timeout_s,
            )
        except CacheGenError as exc:
            return self._failed(exc, plan, controller)
        self.history.learn(stats, link, nominal)
        error = None
        if stats.recompute_from is not None:
            error = (
                f"adaptive controller left chunks from {plan.rows[stats.recompute_from][0]} "
                "on to recomputation"
            )
        return LoadResult(
            plan.chunks_done(stats.n_loaded), error, self._report(stats, plan, controller)
        )

    def _failed(self, exc: CacheGenError, plan: LoadPlan, controller: Any) -> LoadResult:
        """The result of a load that stopped on ``exc``, its damaged record deleted."""
        partial = getattr(exc, "stats", None)
        loaded = partial.n_loaded if partial else 0
        if damaged(exc) and partial is not None and loaded < len(plan.records):
            record = plan.records[loaded]
            if controller is not None:
                record = _chosen_record(controller, loaded, plan) or record
            drop_damaged(self.store, record)
        report = self._report(partial, plan, controller)
        return LoadResult(plan.chunks_done(loaded), f"{type(exc).__name__}: {exc}", report)

    def _report(self, stats: Any, plan: LoadPlan, controller: Any) -> dict[str, Any]:
        """The load's statistics, the plan's extra entries and the controller's choices."""
        report = self.parts.report(stats_report(stats), stats, plan.rows)
        return {**report, **plan.extra, **decisions(controller)}

    def close(self) -> None:
        self.sources.close()


def _chosen_record(controller: Any, index: int, plan: LoadPlan) -> Any:
    """The record the controller fetched for record ``index`` (None: not known)."""
    for decision in reversed(controller.decisions):
        if decision.index == index and decision.choice != "recompute":
            return controller.record(index, decision.choice, plan.records[index])
    return None
