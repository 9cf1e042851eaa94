"""The connector's counters for vLLM's metrics: logged by vLLM's stat logger and exported
by its OpenAI server's ``/metrics`` (docs/connector.md, "Metrics").

The scheduler side counts each finished request (lookups, hits, loaded bytes and seconds,
recompute fallbacks by reason), the worker side each save; vLLM collects both every step
(``get_kv_connector_stats``), ships the data between processes as a plain dict, and hands it
to ``CacheGenStats`` (log lines) and ``CacheGenPromMetrics`` (Prometheus).
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# name -> (Prometheus documentation, label beside vLLM's own: "mode" or "reason")
COUNTERS = {
    "lookups": ("Requests the connector looked up in the store", "mode"),
    "hits": ("Requests that loaded at least one chunk", "mode"),
    "hit_tokens": ("Prompt tokens loaded from the store", "mode"),
    "loaded_bytes": ("Bytes fetched from the store by loads", "mode"),
    "fallbacks": ("Requests recomputed (in part or whole) instead of loaded, by reason", "reason"),
    "saves": ("Prompts whose new chunks were stored", "mode"),
    "saves_skipped": ("Prompts whose new chunks were not stored, by reason", "reason"),
    "hook_errors": ("Exceptions a connector hook contained, by hook", "reason"),
    "saved_bytes": ("Bytes written to the store by saves", "mode"),
}
LOAD_SECONDS = "load_seconds"  # a histogram of each load's seconds, by mode
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "vllm:cachegen_"  # vLLM unregisters its "vllm:" collectors when it builds new ones


class StatsRecorder:
    """Thread-safe counts of one interval (the worker's saver threads count too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, dict[str, Any]] = {}

    def count(self, name: str, label: str, amount: float = 1) -> None:
        self._add({name: {label: amount}})

    def observe_load(self, mode: str, seconds: float) -> None:
        self._add({LOAD_SECONDS: {mode: [seconds]}})

    def _add(self, data: dict[str, dict[str, Any]]) -> None:
        with self._lock:
            _merge(self._data, data)

    def take(self) -> CacheGenStats | None:
        """The interval's stats (None when nothing happened), starting a new interval."""
        with self._lock:
            data, self._data = self._data, {}
        return CacheGenStats(data) if data else None


def _merge(into: dict[str, dict[str, Any]], other: dict[str, dict[str, Any]]) -> None:
    for name, by_label in other.items():
        mine = into.setdefault(name, {})
        for label, value in by_label.items():
            if isinstance(value, list):
                mine[label] = [*mine.get(label, []), *value]
            else:
                mine[label] = mine.get(label, 0) + value


class CacheGenStats(KVConnectorStats):
    """``data``: ``{counter: {mode or reason: total}, "load_seconds": {mode: [seconds]}}``."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> CacheGenStats:
        _merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = {
            name: sum(by_label.values())
            for name, by_label in self.data.items()
            if name != LOAD_SECONDS
        }
        seconds = [s for values in self.data.get(LOAD_SECONDS, {}).values() for s in values]
        if seconds:
            summary["mean_load_s"] = round(sum(seconds) / len(seconds), 4)
        return summary

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CacheGenPromMetrics(KVConnectorPromMetrics):
    """The counters and the load-seconds histogram, per engine, with vLLM's labels."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=PREFIX + name, documentation=doc, labelnames=[*labelnames, label]
            )
            for name, (doc, label) in COUNTERS.items()
        }
        self._load_seconds = self._histogram_cls(
            name=PREFIX + LOAD_SECONDS,
            documentation="Seconds each load took, from its start to its last chunk in the cache",
            labelnames=[*labelnames, "mode"],
            buckets=list(LOAD_BUCKETS),
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, by_label in transfer_stats_data.items():
            if name == LOAD_SECONDS:
                for mode, values in by_label.items():
                    for seconds in values:
                        self._load_seconds.labels(*labels, mode).observe(seconds)
            elif name in self._counters:
                for label, amount in by_label.items():
                    self._counters[name].labels(*labels, label).inc(amount)
