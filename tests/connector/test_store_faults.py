"""Faults and what a request is owed (docs/connector.md, "Failures fall back to
recomputation"): a store that stops answering never holds the engine, since every question the
scheduler puts to it has a deadline and a breaker keeps the next requests from asking a store
that is down until one probe finds it back; and KV computed on top of a lossy load is never
stored as if a full prefill had made it.

The store is a real redis-server, stopped with SIGSTOP, as a partitioned or hung server
behaves: connections stay open and nothing answers."""

from __future__ import annotations

import time

import pytest

from tests.support import connector_engine

BACKOFF_S = 5.0  # longer than one request: the next one meets the breaker open
CHUNKS = 7


@pytest.fixture(scope="module")
def engine(smollm2, redis_server):
    with connector_engine(
        smollm2,
        redis_server.url,
        save_modes=("int8", "raw"),
        connector_extra={"store_backoff_s": BACKOFF_S},
    ) as eng:
        yield eng


def _stored(engine, ids, chunks: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.stored_chunks(ids, mode="int8") < chunks:
        assert time.monotonic() < deadline, "the save did not finish"
        time.sleep(0.05)


def test_a_hung_store_costs_a_fresh_request_a_deadline_then_nothing(engine, redis_up, text_ids):
    prompts = [text_ids(engine, CHUNKS * 256 + 40, offset=o) for o in range(0, 50_000, 10_000)]
    engine.run(prompts[0], mode="int8", save=True)  # the engine's first request: warm
    _stored(engine, prompts[0], CHUNKS)
    up = engine.run(prompts[1], mode="int8", save=True)  # fresh: a miss, then a save
    assert up.connector["save_chunks"] == CHUNKS and "error" not in up.connector
    _stored(engine, prompts[1], CHUNKS)
    redis_up.pause()
    try:
        hung = engine.run(prompts[2], mode="int8", save=True)
        down = engine.run(prompts[3], mode="int8", save=True)  # while the breaker is open
    finally:
        redis_up.resume()
    print(f"\nfresh request: {up.e2e_s:.2f} s with the store up, {hung.e2e_s:.2f} s hung")
    assert hung.connector["fallback"] == "store_timeout" and hung.cached_tokens == 0
    # its save's question went out with its lookup, and came no sooner
    assert hung.connector["save_skipped"] == "store_timeout"
    # Within store_backoff_s of the timeout the next request does not ask the store; on a
    # machine slow enough to take longer than that over the hung request, it probes and waits
    # out one deadline: either way no more than the first did.
    assert down.connector["fallback"] in ("store_down", "store_timeout") and down.cached_tokens == 0
    assert hung.e2e_s <= 1.5 * up.e2e_s and down.e2e_s <= 1.5 * up.e2e_s
    time.sleep(BACKOFF_S)
    # the probe finds the store back: the request saves
    again = engine.run(prompts[4], mode="int8", save=True)
    assert again.connector["save_chunks"] == CHUNKS and "error" not in again.connector
    _stored(engine, prompts[4], CHUNKS)
    hit = engine.run(prompts[4], mode="int8")
    assert hit.connector["loaded_tokens"] == CHUNKS * 256


def test_kv_computed_after_a_lossy_load_is_not_stored_so_reuse_does_not_compound(
    engine, redis_up, text_ids
):
    """A request that loads a document's chunks as int8 computes its own chunks on that KV:
    stored, they would be taken for a full prefill's by the next request, which would compute
    on them in turn. The second generation of reuse loads what the first did, the full
    prefill's chunks, and nothing derived from a lossy load."""
    doc = text_ids(engine, 3 * 256, offset=60_000)
    more = text_ids(engine, 2 * 256, offset=70_000)
    tail = text_ids(engine, 2 * 256 + 40, offset=80_000)
    engine.store_prefix(doc)  # a full prefill stores the document, in both forms
    first = engine.run(doc + more, mode="int8", save=True)
    assert first.connector["loaded_tokens"] == 3 * 256
    assert first.connector["save_skipped"] == "lossy_ancestry"
    assert engine.stored_chunks(doc + more, mode="int8") == 3
    second = engine.run(doc + more + tail, mode="int8", save=True)
    assert second.connector["loaded_tokens"] == first.connector["loaded_tokens"]
    assert second.connector["save_skipped"] == "lossy_ancestry"
    # A lossless load (raw) computes on the exact KV: what it computes is stored.
    exact = engine.run(doc + more, mode="raw", save=True)
    assert exact.connector["loaded_tokens"] == 3 * 256 and exact.connector["save_chunks"] == 2
    _stored(engine, doc + more, 5)
