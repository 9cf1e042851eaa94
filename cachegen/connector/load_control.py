"""How a load plan is streamed: its controller, what each decoded record must be, and what the
load reports."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cachegen.connector.errors import ConnectorError
from cachegen.connector.load_plan import LoadPlan, LossBound, TimeBudget
from cachegen.connector.parts import Plan, RecordParts
from cachegen.errors import CacheGenError
from cachegen.kv import KVCache, ModelIdentity
from cachegen.store import RecordAddress
from cachegen.stream import AdaptiveController, FastestController


def controller_of(
    plan: LoadPlan, chunk_tokens: int, prefill_tps: float, initial_mbps: float | None, priors
) -> AdaptiveController | FastestController | None:
    """The controller that runs ``plan``'s strategy (None: a fixed form), with ``priors``:
    what earlier loads taught about each form (``LoadHistory.priors``)."""
    strategy, tokens = plan.strategy, [chunk_tokens] * len(plan.records)
    if isinstance(strategy, TimeBudget):
        return AdaptiveController(
            strategy.slo_ms / 1000.0,
            strategy.sizes,
            tokens,
            prefill_tokens_per_s=prefill_tps,
            initial_mbps=initial_mbps,
        )
    if isinstance(strategy, LossBound):
        decode_s_per_token, host_mbps = priors
        return FastestController(
            strategy.options,
            tokens,
            max_loss_pct=strategy.max_loss_pct,
            prefill_tokens_per_s=prefill_tps,
            initial_mbps=initial_mbps,
            decode_s_per_token=decode_s_per_token,
            host_mbps=host_mbps,
        )
    return None


def decisions(controller: Any) -> dict[str, Any]:
    """The controller's choices for the report: per record fetched, its ``choice`` (a form
    name, or ``recompute``) and ``predicted_s`` (None before any measurement)."""
    if controller is None:
        return {}
    out = []
    for decision in controller.decisions:
        entry = decision.to_dict()
        if entry["predicted_s"] != entry["predicted_s"]:  # NaN: chosen before measuring
            entry["predicted_s"] = None
        out.append(entry)
    return {"decisions": out}


@dataclass(frozen=True)
class RecordCheck:
    """Hands each decoded record of ``plan`` to ``on_chunk`` after checking it is the record
    planned: the prompt's tokens ``token_ids`` at its chunk, this model's geometry, and the
    layers of its part. :meth:`expect` checks a record's bitstream header the same way before
    it is decoded."""

    plan: Plan
    token_ids: Sequence[int]
    identity: ModelIdentity
    parts: RecordParts
    on_chunk: Callable[[KVCache], None]

    def expect(self, header: Any) -> None:
        """Refuse a bitstream header (``cachegen.codec.coding.bitstream.Header``) that no record
        of the plan can have: decoding sizes its output from the header, so a forged one must
        not get that far. Every record is one whole chunk of this model, starting at a planned
        chunk, holding the layers of a planned part."""
        C = self.parts.chunk_tokens
        model = self.identity
        geometry = (header.model.num_layers, header.num_kv_heads, header.head_dim)
        if geometry != (model.num_layers, model.num_kv_heads, model.head_dim):
            raise ConnectorError(
                f"a record's header claims the KV geometry {geometry} (layers, heads, head_dim), "
                f"not this model's; refused before decoding"
            )
        if header.num_tokens != C or header.start not in {chunk * C for chunk, _ in self.plan}:
            raise ConnectorError(
                f"a record's header claims {header.num_tokens} tokens from position "
                f"{header.start}, not a planned chunk of {C}; refused before decoding"
            )
        if header.layers not in {self.parts.layers(part) for _, part in self.plan}:
            raise ConnectorError(
                "a record's header lists layers that no planned part holds; refused before decoding"
            )

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


def drop_damaged(store: Any, record: RecordAddress) -> None:
    """Delete the damaged ``record`` a load stopped on, so that the recomputation that follows
    stores it afresh."""
    try:
        store.remove(record)
    except CacheGenError:
        pass  # the store is failing anyway; the entry stays damaged and keeps being recomputed


def stats_report(stats: Any) -> dict[str, Any]:
    """A load's statistics for its report (empty without any)."""
    if stats is None:
        return {}
    return {
        "bytes": stats.bytes,
        "forms": list(stats.forms),
        "transfer_s": stats.transfer_s,
        "decode_s": stats.decode_s,
        "inject_s": stats.consume_s,
        "wait_bytes_s": stats.wait_bytes_s,
        "goodput_mbps": stats.goodput_mbps,
    }
