"""How one load is streamed: at a fixed level or under a controller, what each decoded record
must be, and what the load reports."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachegen.connector.config import RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.connector.parts import Plan, RecordParts
from cachegen.errors import CacheGenError
from cachegen.kv import KVCache, ModelIdentity
from cachegen.stream import AdaptiveController, FastestController, Option


@dataclass
class LoadControl:
    """What streams a load: a fixed ``level`` or a ``controller``; ``sizes`` per level or
    form (payload bytes per record, None: not stored), when known; ``extra``: the report's
    entries beyond the load's statistics; ``refused``: why the load may not start."""

    level: int | None = None
    controller: Any = None
    sizes: dict[Any, list[int | None]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None

    def stream_options(self) -> dict[str, Any]:
        """``stream_load``'s keywords."""
        if self.controller is not None:
            return {"controller": self.controller}
        return {"level": self.level}

    def decisions(self) -> dict[str, Any]:
        """The controller's choices for the report: per record fetched, its ``choice`` (a
        level, a form name, or ``recompute``) and ``predicted_s`` (None before any
        measurement)."""
        if self.controller is None:
            return {}
        decisions = []
        for decision in self.controller.decisions:
            entry = decision.to_dict()
            if entry["predicted_s"] != entry["predicted_s"]:  # NaN: chosen before measuring
                entry["predicted_s"] = None
            decisions.append(entry)
        return {"decisions": decisions}


def adaptive_control(
    sizes: dict[Any, list[int | None]],
    records: int,
    options: RequestOptions,
    chunk_tokens: int,
    prefill_tps: float,
    initial_mbps: float | None,
) -> LoadControl:
    """An ``adaptive`` load of ``records`` records under ``slo_ms`` among the levels of
    ``sizes`` (None where a record is not, or not yet, stored at a level: the controller skips
    it there)."""
    assert options.slo_ms is not None
    controller = AdaptiveController(
        options.slo_ms / 1000.0,
        sizes,
        [chunk_tokens] * records,
        prefill_tokens_per_s=prefill_tps,
        initial_mbps=initial_mbps,
    )
    return LoadControl(controller=controller, sizes=sizes)


def fastest_control(
    forms: list[Option],
    options: RequestOptions,
    chunk_tokens: int,
    prefill_tps: float,
    initial_mbps: float | None,
    priors: tuple[dict[str, float], dict[str, float]],
) -> FastestController:
    """The controller of an ``adaptive`` load under ``max_loss_pct``, with ``priors``: what
    earlier loads taught about each form (``LoadHistory.priors``)."""
    assert options.max_loss_pct is not None
    decode_s_per_token, host_mbps = priors
    return FastestController(
        forms,
        [chunk_tokens] * len(forms[0].keys),
        max_loss_pct=float(options.max_loss_pct),
        prefill_tokens_per_s=prefill_tps,
        initial_mbps=initial_mbps,
        decode_s_per_token=decode_s_per_token,
        host_mbps=host_mbps,
    )


def over_load_cap(
    cap: int | None,
    fetch: Sequence[str],
    sizes: dict[Any, list[int | None] | None],
    store_sizes: Callable[[Sequence[str], Any], list[int | None]],
) -> str | None:
    """Why a load of ``fetch`` at one of the levels of ``sizes`` (payload bytes per record,
    looked up with ``store_sizes`` when None) may not start under ``max_load_bytes``
    ``cap`` (None: it may). An adaptive load is held to its cheapest level per record."""
    if cap is None:
        return None
    per_level = [store_sizes(fetch, lv) if known is None else known for lv, known in sizes.items()]
    need = sum(min((s for s in record if s is not None), default=0) for record in zip(*per_level))
    if need <= cap:
        return None
    return (
        f"the load needs {need} bytes, more than max_load_bytes={cap}; "
        "recomputing instead (raise max_load_bytes to load prefixes this long)"
    )


@dataclass(frozen=True)
class RecordCheck:
    """Hands each decoded record of ``plan`` to ``on_chunk`` after checking it is the record
    planned: the prompt's tokens ``token_ids`` at its chunk, this model's geometry, and the
    layers of its part."""

    plan: Plan
    token_ids: Sequence[int]
    identity: ModelIdentity
    parts: RecordParts
    on_chunk: Callable[[KVCache], None]

    def __call__(self, index: int, kv: KVCache) -> None:
        chunk, part = self.plan[index]
        C = self.parts.chunk_tokens
        start = chunk * C
        expected = torch.as_tensor(self.token_ids[start : start + C], dtype=torch.int64)
        if kv.start != start or not torch.equal(kv.token_ids, expected):
            raise ConnectorError(f"chunk {chunk} decodes to tokens of another prefix")
        model = self.identity
        if (kv.model.num_layers, kv.num_kv_heads, kv.head_dim) != (
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
        ):
            raise ConnectorError(f"chunk {chunk} has the KV geometry of another model")
        if kv.layers != self.parts.layers(part):
            what = "all layers" if part is None else f"its {part} layers"
            raise ConnectorError(
                f"chunk {chunk}: a record for {what} decodes to layers {list(kv.layer_indices)}"
            )
        self.on_chunk(kv)


def drop_damaged(
    store: Any, fetch: Sequence[str], index: int, choice: Any, controller: Any
) -> None:
    """Delete the damaged record a load stopped on, record ``index`` of ``fetch`` as the load
    chose it (``choice``: a level, or a form of a ``FastestController``, which names its
    record), so that the recomputation that follows stores it afresh."""
    key, level = fetch[index], choice
    if isinstance(controller, FastestController) and choice in controller.options:
        key, level = controller.record(index, choice, key)
    if not isinstance(level, int):
        return
    try:
        store.delete(key, level)
    except CacheGenError:
        pass  # the store is failing anyway; the entry stays damaged and keeps being recomputed


def stats_report(stats: Any) -> dict[str, Any]:
    """A load's statistics for its report (empty without any)."""
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
