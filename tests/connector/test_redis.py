"""The connector over a real redis-server: the store going down, and the adaptive controller
giving up. Every fallback must produce the cache-less answer.

This module's engine loads and saves inline (``load_async``/``save_async`` off), so the
failure paths of both placements are covered: test_engine.py runs the default
background loads through the same kinds of failure."""

from __future__ import annotations

import threading

import pytest

from cachegen_lab.network.server import DEFAULT_PREFETCH
from tests.support import connector_engine


@pytest.fixture(scope="module")
def engine(tiny_llama, redis_server):
    with connector_engine(
        tiny_llama,
        redis_server.url,
        save_modes=("raw", "cachegen"),
        cachegen_levels=(1, 3),
        load_async=False,
        save_async=False,
        # A store that failed counts as down for store_backoff_s: short here, since each test
        # restarts the store and stores a prompt at once.
        connector_extra={"store_backoff_s": 0.1},
    ) as eng:
        yield eng


def test_store_down_at_lookup_recomputes(engine, redis_up, text_ids):
    ids = text_ids(engine, 600, offset=5_000)
    engine.store_prefix(ids)
    text = engine.run(ids)
    redis_up.stop()
    hit = engine.run(ids, mode="raw")
    # the report names the reason; what the store answered is in the server's log
    assert hit.connector["fallback"] == "store_error" and "lookup failed" in hit.connector["error"]
    assert hit.cached_tokens == 0
    assert hit.token_ids == text.token_ids


def test_store_down_during_the_load_recomputes_the_rest(engine, redis_up, text_ids):
    ids = text_ids(engine, 1850, offset=15_000)  # 7 chunks
    engine.store_prefix(ids)
    text = engine.run(ids)
    # At 10 Mbit/s each 0.5 MB chunk takes ~0.4 s; the store dies while chunk 0 is on the wire.
    # The chunk server reads at most DEFAULT_PREFETCH (4) chunks ahead of the one it is
    # sending, so it asks the dead store for chunk 5 once chunk 1 goes on the wire.
    assert DEFAULT_PREFETCH == 4
    killer = threading.Timer(0.15, redis_up.stop)
    killer.start()
    hit = engine.run(ids, mode="raw", bandwidth_mbps=10)
    killer.join()
    assert hit.connector["load_error"]
    assert hit.connector["loaded_tokens"] < 7 * 256
    assert hit.token_ids == text.token_ids


def test_adaptive_controller_gives_up_and_vllm_recomputes(engine, redis_up, text_ids):
    ids = text_ids(engine, 800, offset=25_000)
    engine.store_prefix(ids)
    text = engine.run(ids)
    # 1 Mbit/s cannot deliver even the smallest level within 1 ms: recompute from text.
    hit = engine.run(ids, mode="adaptive", slo_ms=1, bandwidth_mbps=1)
    assert hit.connector["forms"][0] == "recompute"
    assert hit.connector["loaded_tokens"] == 0
    assert hit.token_ids == text.token_ids
    # With a generous budget the same prompt loads at the best level.
    best = engine.run(ids, mode="adaptive", slo_ms=60_000)
    assert best.connector["loaded_tokens"] == 768 and "load_error" not in best.connector
