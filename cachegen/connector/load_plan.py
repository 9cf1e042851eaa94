"""One load plan per request: which records a load fetches and how it chooses among them.

The scheduler builds a request's plan once, when vLLM grants its load (``plan_load``), from the
``StoreIndex``, by one strategy per kind of request:

* ``FixedForm``: every record in the one form the request names (or the engine's default);
* ``TimeBudget``: ``adaptive`` with ``slo_ms``: per chunk, the finest stored cachegen level that
  keeps the load within the budget (``cachegen.stream.AdaptiveController``);
* ``LossBound``: ``adaptive`` with ``max_loss_pct``: per chunk, the fastest stored form within
  the quality bound (``cachegen.stream.FastestController``).

The worker runs the plan as it is (``cachegen.connector.loader``): it never looks the store up.
Plans are plain data: vLLM may ship them between processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cachegen.connector.config import RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.connector.index import StoreIndex
from cachegen.connector.parts import Plan
from cachegen.modes import ADAPTIVE, CACHEGEN, LOSSLESS, Form
from cachegen.store import RecordAddress
from cachegen.stream import Option


@dataclass(frozen=True)
class FixedForm:
    """Every record as the plan addresses it."""


@dataclass(frozen=True)
class TimeBudget:
    """Per chunk a level within ``slo_ms``; ``sizes``: per form name, each record's payload
    bytes (None: not stored)."""

    slo_ms: float
    sizes: dict[str, list[int | None]]


@dataclass(frozen=True)
class LossBound:
    """Per chunk the fastest of ``options`` (stored forms, with their records, sizes and
    losses) whose loss is at most ``max_loss_pct``."""

    max_loss_pct: float
    options: list[Option]


Strategy = FixedForm | TimeBudget | LossBound


@dataclass
class LoadPlan:
    """A request's load: tokens ``[begin, end)`` of ``token_ids`` (the prompt through the last
    chunk fetched), as the records ``records`` (``rows[i]``: the (chunk, part) of record i)
    chosen among by ``strategy``. ``refused``: why the load may not start (the request
    recomputes); ``extra``: the report's entries beyond the load's statistics."""

    token_ids: list[int]
    begin: int
    end: int
    rows: Plan
    records: list[RecordAddress]
    options: RequestOptions
    strategy: Strategy = field(default_factory=FixedForm)
    refused: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def lossless(self) -> bool:
        """Whether every record the plan may load holds the KV exactly (``raw``): a prompt
        computed on top of another form's KV is not what a full prefill computes."""
        strategy = self.strategy
        if isinstance(strategy, TimeBudget):
            return False
        if isinstance(strategy, LossBound):
            allowed = [o for o in strategy.options if o.within(strategy.max_loss_pct)]
            return all(o.name in LOSSLESS for o in allowed)
        return all(r.form.label in LOSSLESS for r in self.records)

    def chunks_done(self, n_loaded: int) -> int:
        """Chunks complete after the first ``n_loaded`` records."""
        if n_loaded >= len(self.rows):
            return len({chunk for chunk, _ in self.rows})
        return self.rows[n_loaded][0] - self.rows[0][0]


def plan_load(
    index: StoreIndex,
    token_ids: list[int],
    begin: int,
    end: int,
    options: RequestOptions,
    max_load_bytes: int | None = None,
) -> LoadPlan:
    """The plan of a load of tokens ``[begin, end)`` of the prompt ``token_ids`` with
    ``options``: the chunks that hold them, by the strategy of ``options``; refused when it
    would move more than ``max_load_bytes``."""
    C = index.chunk_tokens
    first, last = begin // C, -(-end // C)
    rows = index.parts.load_plan(first, last - first, end, options)
    prefix = list(token_ids[: last * C])
    keys = index.keys(index.ladder.lookup_codec(options), prefix, options.salt)[first:]
    if len(keys) != last - first:
        raise ConnectorError(f"{len(token_ids)} tokens do not hold chunks {first}..{last - 1}")
    plan = LoadPlan(prefix, begin, end, rows, [], options)
    strategy_of(options)(index, plan, keys)
    if plan.refused is None and max_load_bytes is not None:
        plan.refused = over_load_cap(max_load_bytes, _sizes_per_form(index, plan))
    return plan


def strategy_of(options: RequestOptions) -> Callable[[StoreIndex, LoadPlan, list[str]], None]:
    """The function that fills in a plan's records and strategy for ``options``."""
    if options.mode != ADAPTIVE:
        return _fixed_form
    return _loss_bound if options.max_loss_pct is not None else _time_budget


def _fixed_form(index: StoreIndex, plan: LoadPlan, keys: list[str]) -> None:
    (form,) = index.ladder.load_forms(plan.options)
    plan.records = index.parts.plan_records(keys, plan.rows[0][0], plan.rows, form)


def _time_budget(index: StoreIndex, plan: LoadPlan, keys: list[str]) -> None:
    first = plan.rows[0][0]
    sizes = {}
    for level in index.ladder.adaptive_levels:
        form = Form(CACHEGEN, level)
        records = index.parts.plan_records(keys, first, plan.rows, form)
        sizes[form.label] = index.sizes(records)
        plan.records = plan.records or records
    assert plan.options.slo_ms is not None
    plan.strategy = TimeBudget(float(plan.options.slo_ms), sizes)


def _loss_bound(index: StoreIndex, plan: LoadPlan, keys: list[str]) -> None:
    options = index.stored_options(plan.token_ids, plan.rows, plan.options.salt)
    plan.extra["form_loss_pct"] = {o.name: o.loss_pct for o in options}
    bound = float(plan.options.max_loss_pct)
    plan.strategy = LossBound(bound, options)
    allowed = [o for o in options if o.within(bound)]
    plan.records = list(allowed[0].addresses) if allowed else []
    if not allowed:
        plan.refused = (
            f"max_loss_pct={plan.options.max_loss_pct}: no option has a loss of at most "
            f"{bound}% (the stored forms' losses: {plan.extra['form_loss_pct']}); raise the bound"
        )


def _sizes_per_form(index: StoreIndex, plan: LoadPlan) -> list[list[int | None]]:
    """Each choice's record sizes: the forms a controller chooses among, or the plan's."""
    strategy = plan.strategy
    if isinstance(strategy, TimeBudget):
        return list(strategy.sizes.values())
    if isinstance(strategy, LossBound):
        return [list(o.sizes) for o in strategy.options if o.within(strategy.max_loss_pct)]
    return [index.sizes(plan.records)]


def over_load_cap(cap: int, sizes: list[list[int | None]]) -> str | None:
    """Why a load whose choices have record ``sizes`` (payload bytes per record, None: not
    stored) may not start under ``max_load_bytes`` ``cap`` (None: it may). A load that
    chooses per record is held to its cheapest choice per record."""
    need = sum(min((s for s in record if s is not None), default=0) for record in zip(*sizes))
    if need <= cap:
        return None
    return (
        f"the load needs {need} bytes, more than max_load_bytes={cap}; "
        "recomputing instead (raise max_load_bytes to load prefixes this long)"
    )
