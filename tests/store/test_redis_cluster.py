"""A real Redis Cluster (3 masters, 3 replicas) under faults, through the project's code paths.

The module fixture starts six ``redis-server`` processes on free loopback ports and joins them
with ``redis-cli --cluster create`` (``redis_cluster`` in tests/conftest.py). The tests share
that cluster and run in file order: the failover test kills a master (its replica takes over;
the dead node is restarted and rejoins as a replica), and the last test kills a master *and*
its replica, leaving the cluster without quorum for a slot range.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import redis
import torch

from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.transport import ChunkTransport
from cachegen.extract import extract_kv
from cachegen.store import (
    ChunkMissing,
    RecordAddress,
    StoreConfigError,
    StoreError,
    StoreUnavailable,
    open_store,
)
from cachegen.store.keys import key_scope
from tests.support import CHUNK

PASSWORD = "pw-Cl7x-never-shown"  # the cluster requires it; no message may echo it
N_CHUNKS = 8
# Small timeouts and one retry: a dead node turns into an error within a fraction of a second.
FAST = "timeout_s=0.5&retries=1"


# ---- the cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(redis_cluster):
    return redis_cluster(password=PASSWORD, query=FAST)


# ---- 1. the store --------------------------------------------------------------------------


def test_store_round_trip_spreads_chunks_over_the_masters(cluster):
    keys = [f"ns/chunk{i:03d}" for i in range(24)]
    with open_store(cluster.url()) as store:
        assert store.cluster and "password_file=" in store.label and PASSWORD not in store.label
        for i, key in enumerate(keys):
            for level in (0, 1, 2):
                store.put(key, level, bytes([i, level]) * (100 + i))
        for i, key in enumerate(keys):
            assert store.get(key, 1) == bytes([i, 1]) * (100 + i)
        with pytest.raises(ChunkMissing):
            store.get("ns/absent", 0)

        # Keys land on every master; all levels of a chunk share one slot (the hash tag).
        per_master = cluster.keys_per_master()
        assert len(per_master) == 3
        assert all(names for names in per_master.values()), {
            p: len(v) for p, v in per_master.items()
        }
        assert sum(len(v) for v in per_master.values()) == 3 * len(keys)
        with contextlib.closing(cluster.client(cluster.ports[0])) as c:
            for key in keys:
                slots = {
                    c.execute_command("CLUSTER KEYSLOT", f"cachegen:{{{key}}}:L{lv}")
                    for lv in (0, 1, 2)
                }
                assert len(slots) == 1
        for port, names in per_master.items():  # and on one master
            for name in names:
                chunk = name.decode().split("{")[1].split("}")[0]
                assert all(f"cachegen:{{{chunk}}}:L{lv}".encode() in names for lv in (0, 1, 2)), (
                    port,
                    chunk,
                )

        lookup = [*keys[:3], "ns/absent", keys[-1]]
        assert store.exists_many(lookup, 2) == [True, True, True, False, True]
        assert store.sizes(lookup, 0) == [200, 202, 204, None, 2 * 123]
        listed = sorted((e.key, e.level, e.size) for e in store.list("ns/"))
        assert listed == sorted(
            (k, lv, 2 * (100 + i)) for i, k in enumerate(keys) for lv in (0, 1, 2)
        )
        assert store.levels(keys[5]) == [0, 1, 2]
        stats = store.stats()
        assert (stats.chunks, stats.entries) == (len(keys), 3 * len(keys))
        assert stats.payload_bytes == 3 * sum(2 * (100 + i) for i in range(len(keys)))
        assert stats.namespaces == {"ns": 3 * len(keys)}
        assert store.delete(keys[0]) == 3
        for key in keys[1:]:
            store.delete(key)
        assert list(store.list()) == []


def test_max_memory_checks_every_master_and_sets_nothing(cluster):
    """``max_memory`` reads each master's settings (CONFIG GET) and refuses a store whose
    masters could evict the codec's tables; it changes no setting of any node."""
    url = cluster.url(query=f"{FAST}&ttl_s=60&max_memory=64mb")
    masters = cluster.masters()
    clients = [cluster.client(port) for port in masters]
    try:
        for client in clients:
            client.config_set("maxmemory-policy", "volatile-lru")
            client.config_set("maxmemory", 32 << 20)
        open_store(url).close()
        clients[-1].config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(StoreConfigError, match=f"node 127.0.0.1:{masters[-1]}.*allkeys-lru"):
            open_store(url)
        assert [c.config_get("maxmemory-policy")["maxmemory-policy"] for c in clients] == [
            "volatile-lru",
            "volatile-lru",
            "allkeys-lru",
        ]
    finally:
        for client in clients:
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 0)
            client.close()


# ---- 2. producer and consumer --------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt(tiny_llama):
    """8 chunks of real KV of tiny-llama, and the token ids they belong to."""
    ids = torch.arange(N_CHUNKS * CHUNK)
    return ids.tolist(), extract_kv(tiny_llama, token_ids=ids)


def _transport(url: str, spec) -> ChunkTransport:
    config = ConnectorConfig.from_extra_config(
        {"store": url, "chunk_tokens": CHUNK, "save_modes": ["raw"]}
    )
    return ChunkTransport(config, spec, spec.identity())


def _options(scope: str) -> RequestOptions:
    """Raw loads in a key scope of their own, so that tests do not see each other's chunks."""
    return RequestOptions(mode="raw", salt=key_scope("cluster-tests", scope))


class Receiver:
    """An ``on_chunk`` that checks each chunk handed to it against the saved KV at once."""

    def __init__(self, kv, first: int = 0) -> None:
        self.expected = kv.chunks(CHUNK)
        self.next = first
        self.bad: list[str] = []

    def __call__(self, chunk) -> None:
        want = self.expected[self.next]
        same = (
            chunk.start == want.start
            and chunk.keys.dtype == want.keys.dtype
            and torch.equal(chunk.keys, want.keys)
            and torch.equal(chunk.values, want.values)
            and torch.equal(chunk.token_ids, want.token_ids)
        )
        if not same:
            self.bad.append(f"chunk {self.next} differs from what was saved")
        self.next += 1


def _load(transport: ChunkTransport, ids, kv, options: RequestOptions, n: int = N_CHUNKS):
    on_chunk = Receiver(kv)
    result = transport.load(ids, 0, n, options, on_chunk)
    return result, on_chunk


def test_producer_saves_real_kv_and_a_consumer_loads_it_bit_identical(cluster, prompt, tiny_llama):
    ids, kv = prompt
    options = _options("roundtrip")
    producer = _transport(cluster.url(cluster.ports[0]), tiny_llama)
    consumer = _transport(cluster.url(cluster.ports[-1]), tiny_llama)  # another entry node
    try:
        assert consumer.stored_chunks(ids, options) == 0
        assert producer.save(ids, kv, ["raw"], salt=options.salt) > 0
        assert producer.save(ids, kv, ["raw"], salt=options.salt) == 0  # already stored
        assert consumer.stored_chunks(ids, options) == N_CHUNKS
        assert consumer.loadable_tokens(ids, options) == N_CHUNKS * CHUNK
        result, received = _load(consumer, ids, kv, options)
        assert (result.chunks_loaded, result.error) == (N_CHUNKS, None)
        assert received.next == N_CHUNKS and received.bad == []
        spread = {p: len(v) for p, v in cluster.keys_per_master().items()}
        assert sum(spread.values()) == N_CHUNKS and sum(1 for v in spread.values() if v) >= 2
    finally:
        producer.close()
        consumer.close()


# ---- 3. failover ---------------------------------------------------------------------------


def test_failover_loads_are_whole_or_cleanly_partial_and_recover(cluster, prompt, tiny_llama):
    ids, kv = prompt
    options = _options("failover")
    producer = _transport(cluster.url(cluster.ports[0]), tiny_llama)
    consumer = _transport(cluster.url(cluster.ports[1]), tiny_llama)
    try:
        producer.save(ids, kv, ["raw"], salt=options.salt)
        # The master to kill: the one holding chunk 3 of the prefix, so loads must miss it.
        key3 = consumer.keys("raw", ids, options.salt)[3]
        with contextlib.closing(cluster.client(cluster.ports[0])) as c:
            slot = c.execute_command("CLUSTER KEYSLOT", f"cachegen:{{{key3}}}:L0")
        victim = next(p for p in cluster.masters() if cluster.count_in_slot(p, slot))
        cluster.wait_replicated(victim)
        assert _load(consumer, ids, kv, options)[0].chunks_loaded == N_CHUNKS

        outcomes: list[tuple[float, object, Receiver]] = []
        escaped: list[BaseException] = []
        stop = threading.Event()
        recovered = threading.Event()

        def consume_in_a_loop() -> None:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    result, received = _load(consumer, ids, kv, options)
                except BaseException as exc:  # must not happen: recorded and asserted on
                    escaped.append(exc)
                    return
                outcomes.append((started, result, received))
                if killed_at and result.error is None and started > killed_at[0]:
                    recovered.set()

        killed_at: list[float] = []
        loader = threading.Thread(target=consume_in_a_loop, daemon=True)
        loader.start()
        while len(outcomes) < 2 and loader.is_alive():
            time.sleep(0.01)
        successor = cluster.replica_of(victim)
        killed_at.append(time.monotonic())
        cluster.kill(victim)
        failover_s = cluster.wait_promoted(successor, timeout_s=15)
        recovered.wait(timeout=15)
        first_ok = next((t for t, r, _ in outcomes if t > killed_at[0] and r.error is None), None)
        stop.set()
        loader.join(timeout=30)
        assert not loader.is_alive()
        assert escaped == []
        failed = [r for t, r, _ in outcomes if r.error is not None]
        print(
            f"\nfailover: replica {successor} promoted and cluster_state:ok {failover_s:.2f} s "
            f"after SIGKILL of master {victim}; "
            f"first full load started after it began {first_ok - killed_at[0]:.2f} s after it; "
            f"{len(outcomes)} loads, {len(failed)} failed cleanly"
            + (f" (first error: {failed[0].error})" if failed else "")
        )
        for _, result, received in outcomes:
            assert received.bad == []  # never a corrupted chunk handed over
            assert received.next == result.chunks_loaded  # nor one more than reported
            if result.error is None:
                assert result.chunks_loaded == N_CHUNKS
            else:
                assert result.chunks_loaded < N_CHUNKS
                assert PASSWORD not in result.error
        assert recovered.is_set(), "no full load after the failover"

        # The promoted replica serves the old prefix; both sides' clients (slot maps from
        # before the failover) save and load a new one.
        options2 = _options("after-failover")
        assert producer.save(ids, kv, ["raw"], salt=options2.salt) > 0
        assert consumer.stored_chunks(ids, options2) == N_CHUNKS
        result, received = _load(consumer, ids, kv, options2)
        assert (result.chunks_loaded, result.error, received.bad) == (N_CHUNKS, None, [])
        result, received = _load(consumer, ids, kv, options)
        assert (result.chunks_loaded, result.error, received.bad) == (N_CHUNKS, None, [])
    finally:
        producer.close()
        consumer.close()
    # The dead node comes back (same nodes.conf) and rejoins as a replica of its successor.
    cluster.start_node(victim)
    deadline = time.monotonic() + 15
    while not any(n["port"] == victim and n["of"] and not n["failed"] for n in cluster.nodes()):
        assert time.monotonic() < deadline, "the restarted node did not rejoin as a replica"
        time.sleep(0.1)
    cluster.wait_ok()


# ---- 4. a hole in a stored prefix ----------------------------------------------------------


def test_a_missing_middle_chunk_cuts_the_prefix(cluster, prompt, tiny_llama):
    ids, kv = prompt
    options = _options("hole")
    transport = _transport(cluster.url(), tiny_llama)
    try:
        transport.save(ids, kv, ["raw"], salt=options.salt)
        keys = transport.keys("raw", ids, options.salt)
        # In the cluster the test removes chunk 3 itself, as an eviction of that one record
        # would (allkeys-lru samples its victims); real eviction: the next test.
        assert transport.store.delete(keys[3]) == 1
        assert transport.store.exists_many(keys, 0) == [True] * 3 + [False] + [True] * 4
        assert transport.stored_chunks(ids, options) == 3
        assert transport.loadable_tokens(ids, options) == 3 * CHUNK
        result, received = _load(transport, ids, kv, options, n=3)
        assert (result.chunks_loaded, result.error, received.bad) == (3, None, [])
        result, received = _load(transport, ids, kv, options)  # past the hole: reported missing
        assert result.chunks_loaded == 3 and received.next == 3 and received.bad == []
        assert "ChunkMissing" in result.error
    finally:
        transport.close()


def test_real_maxmemory_eviction_of_a_middle_chunk_cuts_the_prefix(
    evicting_redis, prompt, tiny_llama
):
    """Real eviction, made deterministic: under ``volatile-ttl`` only keys with a TTL may be
    evicted, and only chunk 3 is written with one (a second store with ``ttl_s``), so when
    memory runs out it is chunk 3, and only it, that goes."""
    ids, kv = prompt
    url = f"redis://127.0.0.1:{evicting_redis}/0?{FAST}"
    options = RequestOptions(mode="raw")
    transport = _transport(url, tiny_llama)
    try:
        transport.save(ids, kv, ["raw"])
        keys = transport.keys("raw", ids)
        form = transport.load_forms(options)[0]
        records = [RecordAddress.of(key, form) for key in keys]
        with open_store(f"{url}&ttl_s=3600") as expiring:
            blob = transport.codec("raw").encode(kv.chunks(CHUNK)[3], level=form.level)
            expiring.write(records[3], blob)
        raw = redis.Redis(port=evicting_redis)
        used = raw.info("memory")["used_memory"]
        raw.config_set("maxmemory", used + 64 * 1024)  # room for less than one more chunk
        with contextlib.suppress(redis.exceptions.OutOfMemoryError):
            raw.set("filler", b"x" * len(blob))
        raw.close()
        assert transport.store.holds(records) == [True] * 3 + [False] + [True] * 4
        assert transport.stored_chunks(ids, options) == 3
        assert transport.loadable_tokens(ids, options) == 3 * CHUNK
        result, received = _load(transport, ids, kv, options, n=3)
        assert (result.chunks_loaded, result.error, received.bad) == (3, None, [])
        result, received = _load(transport, ids, kv, options)
        assert result.chunks_loaded == 3 and received.next == 3 and "ChunkMissing" in result.error
    finally:
        transport.close()


# ---- 5. no quorum --------------------------------------------------------------------------


def test_a_cluster_without_quorum_fails_cleanly(cluster, prompt, tiny_llama):
    ids, kv = prompt
    options = _options("no-quorum")
    transport = _transport(cluster.url(), tiny_llama)
    transport.save(ids, kv, ["raw"], salt=options.salt)
    transport.close()
    master = next(p for p in cluster.masters() if p != cluster.ports[0])
    replica = cluster.replica_of(master)
    if replica == cluster.ports[0]:  # keep the entry node alive
        master = next(p for p in cluster.masters() if p not in (cluster.ports[0], master))
        replica = cluster.replica_of(master)
    cluster.kill(master)
    cluster.kill(replica)
    deadline = time.monotonic() + 15
    while cluster.info(cluster.ports[0])["cluster_state"] != "fail":
        assert time.monotonic() < deadline, "the cluster did not notice it lost a slot range"
        time.sleep(0.1)

    messages: list[str] = []
    try:
        transport = _transport(cluster.url(), tiny_llama)
    except StoreError as exc:
        messages.append(str(exc))
        assert isinstance(exc, StoreUnavailable) and "unavailable" in str(exc)
    else:
        try:
            result, received = _load(transport, ids, kv, options)
            assert result.error is not None and result.chunks_loaded < N_CHUNKS
            assert received.bad == [] and received.next == result.chunks_loaded
            messages.append(result.error)
            with pytest.raises(StoreError) as info:
                transport.stored_chunks(ids, options)
            messages.append(str(info.value))
            assert "unavailable" in str(info.value)
        finally:
            transport.close()
    print("\nno quorum:", *messages, sep="\n  ")
    assert all(PASSWORD not in m for m in messages)
