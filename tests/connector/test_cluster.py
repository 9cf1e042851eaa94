"""The connector's producer and consumer on a real Redis Cluster (3 masters, 3 replicas, a
password), through vLLM with the real model (SmolLM2-135M), under faults.

The engine's store is ``redis+cluster://node?password_file=...``: the requests that save
(producer) and the requests that load (consumer) share the cluster through it. Every answer is
compared with the same engine answering from text (greedy), the ground truth for raw loads and
for every fallback to recomputation. The tests share one cluster and run in file order; the
failover test kills a master for good, so it comes last.
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import redis

from cachegen.connector.config import RequestOptions
from cachegen.store import RecordAddress
from cachegen.store.address import locate
from cachegen_lab.bench.engine import ConnectorEngine, Measurement
from tests.support import CHUNK, ENGINE_DTYPE, connector_engine

PASSWORD = "pw-Cx9-connector-never-shown"  # the cluster requires it; no report may echo it
DOC_CHUNKS = 6  # the documents below put chunks on every master, whatever its slots
# Small timeouts and one retry: a dead node turns into an error within a fraction of a second.
FAST = "timeout_s=0.5&retries=1"
QUESTION = " Question: what is the main point of the text above? Answer:"
OTHER_QUESTION = " Which Python feature does the text explain?"
# A rate-limited link (the chunk server child process paces the records) makes a load of a
# raw SmolLM2 chunk (about 6 MB in bf16, twice that in float32) take about half a second, so a
# master can die mid-load.
SLOW_LINK_MBPS = 100 if ENGINE_DTYPE == "bfloat16" else 200


@pytest.fixture(scope="module")
def cluster(redis_cluster):
    return redis_cluster(password=PASSWORD, query=FAST)


@pytest.fixture(scope="module")
def engine(smollm2, cluster):
    with connector_engine(smollm2, cluster.url(), save_modes=("raw",)) as eng:
        yield eng


@pytest.fixture(scope="module")
def document(engine, text_ids):
    """``document(offset, question, chunks)``: a document of ``chunks`` (DOC_CHUNKS) chunks and
    a question."""

    def make(offset: int, question: str = QUESTION, chunks: int = DOC_CHUNKS) -> list[int]:
        return text_ids(engine, chunks * CHUNK, offset) + engine.tokenize(question, bos=False)

    return make


def _produce(engine: ConnectorEngine, ids: list[int]) -> Measurement:
    """The producer: answer ``ids`` from text with saving on, and wait until its chunks are in
    the cluster. The answer is the reference for loads of the same prompt."""
    answer = engine.run(ids, save=True, margins=True)
    engine.wait_stored(ids, timeout_s=120)
    return answer


def _record_name(engine: ConnectorEngine, ids: list[int], chunk: int) -> str:
    """The Redis key of a raw chunk of ``ids`` (see cachegen/store/redis_backend.py)."""
    (form,) = engine.transport.load_forms(RequestOptions(mode="raw"))
    key, slot = locate(RecordAddress.of(engine.transport.keys("raw", ids)[chunk], form))
    return f"cachegen:{{{key}}}:L{slot}"


def test_producer_saves_into_the_cluster_and_a_consumer_loads_every_chunk(
    engine, cluster, document, assert_answers_alike
):
    saved = document(0)
    assert engine.stored_chunks(saved) == 0
    _produce(engine, saved)
    per_master = {port: len(names) for port, names in cluster.keys_per_master().items()}
    assert sum(per_master.values()) == DOC_CHUNKS and sum(map(bool, per_master.values())) >= 2

    asked = document(0, OTHER_QUESTION)  # another prompt with the same document
    text = engine.run(asked, max_tokens=24, margins=True)
    hit = engine.run(asked, mode="raw", max_tokens=24, margins=True)
    report = hit.connector
    assert report["loaded_tokens"] == DOC_CHUNKS * CHUNK and hit.cached_tokens == DOC_CHUNKS * CHUNK
    assert "load_error" not in report and "error" not in report
    assert report["forms"] == ["raw"] * DOC_CHUNKS
    assert_answers_alike(hit, text)
    assert PASSWORD not in json.dumps(report)


def test_a_chunk_evicted_from_the_middle_loads_the_prefix_before_it(
    engine, cluster, document, assert_answers_alike
):
    """Real maxmemory eviction, made deterministic: only chunk 3 gets a TTL, and its master
    (the only one whose memory is capped) runs ``volatile-ttl``, which evicts only keys with a
    TTL, so when that master runs out of memory it is chunk 3, and only it, that goes."""
    ids = document(30_000)
    text = _produce(engine, ids)
    name = _record_name(engine, ids, 3)
    master = cluster.master_of(name)
    filler = f"filler:{name}"  # the same hash tag: the same slot, so the same master
    with contextlib.closing(cluster.client(master)) as node:
        assert node.expire(name, 3600)
        size = node.strlen(name)
        node.config_set("maxmemory-policy", "volatile-ttl")
        node.config_set("maxmemory", node.info("memory")["used_memory"] + 64 * 1024)
        try:
            with contextlib.suppress(redis.exceptions.OutOfMemoryError):
                node.set(filler, b"x" * size)
            assert not node.exists(name), "chunk 3 was not evicted"
        finally:
            node.config_set("maxmemory", 0)
            node.delete(filler)
    keys = engine.transport.keys("raw", ids)
    records = [RecordAddress.of(key, "raw") for key in keys]
    assert engine.transport.store.holds(records) == [True] * 3 + [False] + [True] * 2
    assert engine.stored_chunks(ids) == 3

    hit = engine.run(ids, mode="raw", margins=True)
    report = hit.connector
    assert report["loaded_tokens"] == 3 * CHUNK and hit.cached_tokens == 3 * CHUNK
    assert "load_error" not in report and "error" not in report
    assert_answers_alike(hit, text)  # the rest, from the hole on, was recomputed


def _loading(engine) -> bool:
    """Whether the connector has sent a request's load to the worker, which runs it in the
    background (the in-process engine's scheduler, as vLLM holds it)."""
    side = engine.llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    return any(tracked.loading for tracked in side._tracked.values())


def _recomputed(hit: Measurement, text: Measurement, answers_alike) -> int:
    """Check a request answered during the outage: the store's failure is the reason in its
    report, and no chunk was injected partially (the answer is the cache-less one, up to a
    near-tie where whole chunks were loaded). Returns the tokens it loaded before the failure."""
    report = hit.connector
    assert PASSWORD not in json.dumps(report)
    if "load_error" in report:  # the load's own error text (the lab's engine sees it whole)
        reason = report["load_error"]
        assert "redis cluster" in reason and "unavailable" in reason, json.dumps(report)
    else:  # the lookup failed: its reason code (the store's text is in the server log)
        assert report.get("fallback") in ("store_error", "store_timeout"), json.dumps(report)
    loaded = report.get("loaded_tokens", 0)
    assert loaded % CHUNK == 0 and loaded < DOC_CHUNKS * CHUNK
    answers_alike(hit, text)  # a partially injected chunk would change it
    return loaded


def test_a_master_killed_during_a_load_every_request_is_answered_and_saves_resume(
    engine, cluster, document, assert_answers_alike
):
    # The second prompt arrives during the outage; two chunks are enough to look up.
    prompts = [document(60_000), document(90_000, chunks=2)]
    texts = [_produce(engine, ids) for ids in prompts]  # answered alone, as the faulted ones are
    # The victim holds the first prompt's last chunk. The chunk server reads records from the
    # store only a few chunks (at most its prefetch_bytes) ahead of the paced link, which
    # delivers a chunk in about half a second, so the load asks the victim for that chunk
    # after the kill (or for an earlier one that it holds).
    victim = cluster.master_of(_record_name(engine, prompts[0], DOC_CHUNKS - 1))
    successor = cluster.replica_of(victim)
    for port in cluster.masters():
        cluster.wait_replicated(port)  # the failover must lose no chunk
    # starts the link
    warm = engine.run(prompts[0], mode="raw", bandwidth_mbps=SLOW_LINK_MBPS, margins=True)
    assert warm.connector["loaded_tokens"] == DOC_CHUNKS * CHUNK
    assert_answers_alike(warm, texts[0])

    # The replica is held (SIGSTOP) until both requests are answered, so that the outage lasts
    # through them however slow this machine is; then it takes over as after any failure.
    with contextlib.closing(cluster.client(successor)) as node:
        node.config_set("cluster-replica-validity-factor", 0)  # however long it was held
    cluster.pause(successor)
    try:
        loading = engine.submit(prompts[0], mode="raw", bandwidth_mbps=SLOW_LINK_MBPS, margins=True)
        steps: list[float] = []
        killed: list[float] = []

        def kill_once_it_loads() -> bool:
            """The lookup answered and the load runs in the background: the victim dies."""
            steps.append(time.perf_counter())
            if not killed and _loading(engine):
                cluster.kill(victim)
                killed.append(time.perf_counter())
            return False

        engine.step_until_done([loading], until=kill_once_it_loads)
        assert killed and steps[-1] > killed[0], "the request finished before the kill"
        print(f"\nmaster {victim} killed {killed[0] - loading.t_submit:.2f} s after the submit")
        hit = loading.measurement()
        assert "load_error" in hit.connector
        loaded = _recomputed(hit, texts[0], assert_answers_alike)
        print(f"loaded {loaded} tokens before the failure")
        # A request that arrives while the slots are down (the cluster says so): its lookup
        # fails, and vLLM computes the whole prompt.
        live = next(p for p in cluster.alive() if p != successor)
        deadline = time.monotonic() + 15
        while cluster.info(live)["cluster_state"] != "fail":
            assert time.monotonic() < deadline, "the cluster did not notice the dead master"
            time.sleep(0.1)
        hit = engine.run(prompts[1], mode="raw")
        assert _recomputed(hit, texts[1], assert_answers_alike) == 0
        assert "lookup failed" in hit.connector["error"]
    finally:
        cluster.resume(successor)
    failover_s = cluster.wait_promoted(successor)
    print(f"\nreplica {successor} promoted {failover_s:.1f} s after it was resumed")

    # After the failover: a new prefix is saved (its chunks in the promoted replica's slots
    # too) and a following load hits, and so does the prefix stored before the kill.
    fresh = document(120_000)
    text = _produce(engine, fresh)
    homes = {cluster.master_of(_record_name(engine, fresh, i)) for i in range(DOC_CHUNKS)}
    assert successor in homes  # some of its chunks were written to the promoted replica
    for ids, reference in ((fresh, text), (prompts[0], texts[0])):
        hit = engine.run(ids, mode="raw", margins=True)
        assert hit.connector["loaded_tokens"] == DOC_CHUNKS * CHUNK
        assert "load_error" not in hit.connector and "error" not in hit.connector
        assert_answers_alike(hit, reference)
