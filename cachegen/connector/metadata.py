"""What the scheduler-side connector tells the workers each step, and what they report back.

Plain dataclasses of ints, strings, lists and load plans: vLLM may ship them between
processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from cachegen.connector.load_plan import LoadPlan


@dataclass
class LoadTask:
    """Run ``plan``: load its tokens ``[begin, end)`` from the store into the request's
    blocks (tokens before ``begin`` are already in vLLM's cache)."""

    req_id: str
    block_ids: list[list[int]]  # one list per KV cache group (several with vLLM's HMA on)
    plan: LoadPlan
    in_background: bool = False  # load in a worker thread while vLLM keeps stepping (load_async)


@dataclass
class SaveTask:
    """Store the full chunks of a prompt whose prefill completes in this step."""

    req_id: str
    token_ids: list[int]  # the prompt's tokens, cut to whole chunks
    block_ids: list[list[int]]  # one list per KV cache group (several with vLLM's HMA on)
    modes: tuple[str, ...]
    first_chunk: int = 0  # chunks before it are already stored in every mode
    # Chunks before it get no sliding-window part: a load skipped their sliding layers' KV, or
    # vLLM's HMA freed their sliding blocks, so the cache holds no valid KV there (models with
    # sliding-window layers only).
    sliding_from: int = 0
    salt: str | None = None  # the key scope of the request (RequestOptions.salt)
    save_id: int = 0  # names the save in LoadReports.saved (unique per scheduler)


@dataclass
class StepMetadata(KVConnectorMetadata):
    step_tokens: int = 0  # tokens vLLM computes in this step (to measure the prefill rate)
    loads: list[LoadTask] = field(default_factory=list)
    saves: list[SaveTask] = field(default_factory=list)


@dataclass
class LoadReports(KVConnectorWorkerMetadata):
    """Per-request statistics of the loads a worker finished in one step, and the saves whose
    first pass (every chunk loadable) it stored, or gave up, since its last report. With
    tensor parallelism vLLM merges every rank's (``aggregate``): a request's report is its
    worst rank's, and only the first rank, which stores, reports saves."""

    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    saved: list[int] = field(default_factory=list)  # SaveTask.save_id values

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, LoadReports):
            merged = dict(self.reports)
            for req_id, report in other.reports.items():
                if req_id not in merged or _worse(report, merged[req_id]):
                    merged[req_id] = report
            return LoadReports(merged, self.saved + other.saved)
        return self


def _worse(report: dict[str, Any], than: dict[str, Any]) -> bool:
    """A failed load over a sound one, else fewer tokens loaded."""
    if ("load_error" in report) != ("load_error" in than):
        return "load_error" in report
    return report.get("loaded_tokens", 0) < than.get("loaded_tokens", 0)
