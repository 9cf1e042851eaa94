"""What the fleet's tests build documents from: a run's settings and setup as fleet-bench
writes them (version 3), without servers."""

from __future__ import annotations

from typing import Any

SETTINGS = {
    "model": "tiny-llama",
    "workload": "multi-round-qa",
    "workload_settings": {"users": 2, "rounds": 2},
    "seed": 0,
    "requests": 4,
    "servers": 2,
    "router": "round-robin",
    "concurrency": 2,
    "max_tokens": 4,
    "api": "responses",
    "ignore_eos": True,
    "bandwidths_mbps": [100.0, None],
    "store": None,
    "slo_ms": 500.0,
    "stop": None,
    "kv_cache_gib": 1,
    "kv_cache_blocks": None,
}


def setup(config: str, connector: bool) -> dict[str, Any]:
    """A run's ``setup`` over a temporary directory store (no tenant)."""
    return {
        "config": config,
        "mode": config if connector else "recompute",
        "prefix_caching": True,
        "connector": connector,
        "connector_extra": {},
        "store": "file:///tmp/chunks" if connector else None,
        "tenant": None,
        "cache_salt": f"fleet-test-{config}",
    }
