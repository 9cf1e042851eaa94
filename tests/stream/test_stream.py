"""Streaming over real TCP sockets: shaping, pipelined fetch+decode, failures, controller."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from cachegen.store import ChunkCorrupt, ChunkMissing, StoreUnavailable, open_store, record
from cachegen.stream import (
    RECOMPUTE,
    AdaptiveController,
    BandwidthTrace,
    ChunkServer,
    DirectSource,
    SocketSource,
    StreamProtocolError,
    StreamTimeout,
    netns,
    open_link,
    protocol,
    stream_load,
)
from cachegen.stream import server as server_module
from cachegen.stream.ratelimit import TokenBucket
from cachegen.stream.source import DIRECT_PREFETCH

LEVELS = (0, 1, 2)
N_CHUNKS = 12
TOKENS = 16


def kv_blob(seed: int, level: int) -> bytes:
    """A real serialized KV chunk (safetensors, bf16); higher levels are bigger, as in a codec."""
    g = torch.Generator().manual_seed(seed * 10 + level)
    shape = (2, 1 + level, TOKENS, 64)
    return st_save(
        {
            "keys": torch.randn(shape, generator=g).bfloat16(),
            "values": torch.randn(shape, generator=g).bfloat16(),
        }
    )


def decode(blob: bytes) -> dict:
    return st_load(blob)


@pytest.fixture
def chunks():
    return {(i, lv): kv_blob(i, lv) for i in range(N_CHUNKS) for lv in LEVELS}


@pytest.fixture
def local_store(tmp_path, chunks):
    s = open_store((tmp_path / "store").as_uri())
    keys = [f"ns/chunk{i:03d}" for i in range(N_CHUNKS)]
    for (i, lv), blob in chunks.items():
        s.put(keys[i], lv, blob)
    s.keys = keys
    return s


def collect():
    got: list = []
    return got, lambda i, kv: got.append((i, kv))


def same_kv(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- traces and the token bucket (pure arithmetic, no clocks) --------------------------


def test_trace_integration():
    t = BandwidthTrace.step(800, 80, 0.5)  # 100 MB/s for 0.5 s, then 10 MB/s
    assert t.bytes_until(0.5) == pytest.approx(50e6)
    assert t.bytes_until(1.5) == pytest.approx(60e6)
    assert t.time_at_bytes(60e6) == pytest.approx(1.5)
    assert t.time_at_bytes(t.bytes_until(0.123)) == pytest.approx(0.123)
    walk = BandwidthTrace.random_walk(100, seed=3)
    assert walk == BandwidthTrace.random_walk(100, seed=3)
    assert all(20 - 1e-9 <= mbps <= 200 + 1e-9 for _, mbps in walk.segments)
    assert BandwidthTrace.parse("step:500:100:0.5") == BandwidthTrace.step(500, 100, 0.5)
    with pytest.raises(Exception, match="cannot read bandwidth trace"):
        BandwidthTrace.parse("sine:5")
    assert BandwidthTrace.from_json(walk.to_json()) == walk
    with pytest.raises(Exception, match='has no "schema" field'):
        BandwidthTrace.from_json('{"name": "x", "segments": [[1.0, 100.0]]}')


def test_token_bucket_never_exceeds_its_rate():
    """Lower bound only: pacing can be slower on a busy machine, never faster than the rate."""
    bucket = TokenBucket(80, burst_bytes=10_000)  # 10 MB/s
    start = time.monotonic()
    for _ in range(50):
        bucket.consume(20_000)
    assert time.monotonic() - start >= (50 * 20_000 - 10_000) / 10e6


def test_a_connection_starts_on_an_idle_link(local_store):
    """Tokens a link banked while idle must not speed up the next connection, even when its
    first response was queued before the sender looked (the fetcher reads ahead)."""
    server = ChunkServer(local_store, rate_mbps=8, burst_bytes=1_000)  # 1 MB/s
    server.bucket.set_origin(time.monotonic() - 5)  # idle for 5 s: 5 MB worth of tokens
    body = b"x" * 200_000
    outbox = server_module._Outbox(2, 1 << 20)
    outbox.put_all([(0, time.monotonic(), protocol.OK, body), None])
    sender, receiver = socket.socketpair()
    received = []
    drain = threading.Thread(target=lambda: received.append(_read_all(receiver)))
    drain.start()
    start = time.monotonic()
    server._send_responses(sender, outbox)
    drain.join()
    assert len(received[0]) > len(body)
    assert time.monotonic() - start >= (len(body) - 1_000) / 1e6


def _read_all(sock: socket.socket) -> bytes:
    parts = []
    while chunk := sock.recv(1 << 16):
        parts.append(chunk)
    sock.close()
    return b"".join(parts)


# ---- loading over real sockets ---------------------------------------------------------


@pytest.mark.parametrize("rate", [None, 200])
def test_socket_load_in_order(local_store, chunks, rate):
    with ChunkServer(local_store, rate_mbps=rate) as server:
        got, consume = collect()
        stats = stream_load(
            SocketSource(server.address), local_store.keys, decode, consume, level=1
        )
    assert [i for i, _ in got] == list(range(N_CHUNKS))
    assert all(same_kv(kv, decode(chunks[(i, 1)])) for i, kv in got)
    assert stats.n_loaded == N_CHUNKS and stats.recompute_from is None
    assert stats.levels == [1] * N_CHUNKS
    assert stats.bytes == sum(len(chunks[(i, 1)]) for i in range(N_CHUNKS))
    assert stats.load_s >= stats.transfer_s > 0 and stats.goodput_mbps > 0
    if rate:  # the kernel cannot deliver faster than the server's bucket lets bytes out
        burst = server.bucket.burst
        assert stats.transfer_s >= (stats.bytes - burst) * 8 / (rate * 1e6)


def test_per_chunk_levels_and_direct_source(local_store, chunks):
    levels = [i % 3 for i in range(N_CHUNKS)]
    got, consume = collect()
    stats = stream_load(DirectSource(local_store), local_store.keys, decode, consume, level=levels)
    assert stats.levels == levels
    assert all(same_kv(kv, decode(chunks[(i, levels[i])])) for i, kv in got)


def test_shared_link_serves_concurrent_loads(local_store):
    with open_link(local_store, bandwidth_mbps=500) as link:
        results = []
        threads = [
            threading.Thread(target=lambda: results.append(stream_load(link.source,
                local_store.keys, len, lambda i, x: None, level=2)))
            for _ in range(3)
        ]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [r.n_loaded for r in results] == [N_CHUNKS] * 3


def test_server_process_serves_redis_with_url_options(redis_url, chunks):
    store = open_store(redis_url + "?prefix=proc&timeout_s=2")
    keys = [f"ns/p{i}" for i in range(4)]
    for i, k in enumerate(keys):
        store.put(k, 1, chunks[(i, 1)])
    with open_link(store, bandwidth_mbps=500, server="process") as link:
        got, consume = collect()
        stream_load(link.source, keys, decode, consume, level=1)
    assert all(same_kv(kv, decode(chunks[(i, 1)])) for i, kv in got) and len(got) == 4


def test_buffer_bounds_memory(local_store):
    """With a slow decoder the fetcher stops after max_buffered chunks (plus one in hand and
    the rest of the store read it came from)."""
    reads = []
    original = local_store.get_records

    def counting_get_records(items):
        reads.extend(key for key, _ in items)
        return original(items)

    local_store.get_records = counting_get_records
    seen = []

    def slow_decode(blob):
        if not seen:
            time.sleep(0.3)  # lets an unbounded fetcher read everything meanwhile
            seen.append(len(reads))
        return len(blob)

    stream_load(
        DirectSource(local_store),
        local_store.keys,
        slow_decode,
        lambda i, x: None,
        level=0,
        max_buffered=2,
    )
    # chunk being decoded + buffer + one waiting to be handed over + its read's other chunks
    assert seen[0] <= 1 + 2 + 1 + DIRECT_PREFETCH - 1


# ---- failures end in typed errors, never in partial chunks -----------------------------


def test_missing_chunk_mid_stream(local_store, chunks):
    local_store.delete(local_store.keys[5], 1)
    got, consume = collect()
    with ChunkServer(local_store) as server:
        with pytest.raises(ChunkMissing) as info:
            stream_load(SocketSource(server.address), local_store.keys, decode, consume, level=1)
    assert info.value.stats.n_loaded == 5
    assert [i for i, _ in got] == list(range(5))
    assert all(same_kv(kv, decode(chunks[(i, 1)])) for i, kv in got)


@pytest.fixture
def redis_chunks(redis_url, chunks):
    s = open_store(redis_url + "?prefix=ahead&timeout_s=2")
    s.keys = [f"ns/ahead{i:03d}" for i in range(N_CHUNKS)]
    for (i, lv), blob in chunks.items():
        s.put(s.keys[i], lv, blob)
    yield s
    s.close()


def _source(kind: str, store, stack):
    if kind == "direct":
        return DirectSource(store)
    server = stack.enter_context(ChunkServer(store, rate_mbps=200, prefetch=3))
    return SocketSource(server.address, secret=store.record_signer)


@pytest.fixture(scope="module")
def cluster_url(redis_cluster):
    return redis_cluster().url(query="timeout_s=2")


@pytest.mark.parametrize("kind", ["server", "direct"])
@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
def test_redis_fetch_ahead_delivers_every_chunk_in_order(request, chunks, kind, backend):
    """Chunks read ahead, several per round trip (on a cluster from every master), arrive
    whole and in order."""
    if backend == "redis":
        store = request.getfixturevalue("redis_chunks")
    else:
        store = open_store(request.getfixturevalue("cluster_url"))
        request.addfinalizer(store.close)
        store.keys = [f"ns/spread{i:03d}" for i in range(N_CHUNKS)]  # slots on every master
        for i, key in enumerate(store.keys):
            store.put(key, 2, chunks[(i, 2)])
    got, consume = collect()
    with contextlib.ExitStack() as stack:
        source = _source(kind, store, stack)
        stats = stream_load(source, store.keys, decode, consume, level=2)
    assert [i for i, _ in got] == list(range(N_CHUNKS)) and stats.n_loaded == N_CHUNKS
    assert all(same_kv(kv, decode(chunks[(i, 2)])) for i, kv in got)


@pytest.mark.parametrize("kind", ["server", "direct"])
def test_redis_fetch_ahead_stops_at_a_missing_chunk(redis_chunks, chunks, kind):
    """Chunks read ahead past a hole are never delivered: the load stops at the hole."""
    redis_chunks.delete(redis_chunks.keys[5], 1)
    got, consume = collect()
    with contextlib.ExitStack() as stack:
        source = _source(kind, redis_chunks, stack)
        with pytest.raises(ChunkMissing) as info:
            stream_load(source, redis_chunks.keys, decode, consume, level=1)
    assert info.value.stats.n_loaded == 5 and [i for i, _ in got] == list(range(5))
    assert all(same_kv(kv, decode(chunks[(i, 1)])) for i, kv in got)


def test_server_reads_ahead_within_its_bounds(local_store, chunks):
    """Several records per store read, never more than ``prefetch`` chunks ahead of the link."""
    batches = []
    original = local_store.get_records

    def recording_get_records(items):
        batches.append(len(items))
        return original(items)

    local_store.get_records = recording_get_records
    got, consume = collect()
    with ChunkServer(local_store, rate_mbps=20, prefetch=3) as server:
        stream_load(SocketSource(server.address), local_store.keys, decode, consume, level=2)
    assert [i for i, _ in got] == list(range(N_CHUNKS))
    assert batches[0] == 1 and sum(batches) == N_CHUNKS and max(batches) <= 3


def test_outbox_bounds_what_is_read_ahead():
    outbox = server_module._Outbox(3, 10_000)
    assert outbox.wait_for_room() == 1  # the sender is idle: one chunk, its bytes soonest
    outbox.put_all([(0, 0.0, protocol.OK, b"a" * 100)])
    assert outbox.get() == ((0, 0.0, protocol.OK, b"a" * 100), False)
    assert outbox.wait_for_room() == 3  # chunk 0 is on the wire: read ahead
    outbox.put_all([(i, 0.0, protocol.OK, b"b" * 6_000) for i in (1, 2)])
    waiter = threading.Thread(target=lambda: rooms.append(outbox.wait_for_room()))
    rooms: list = []
    waiter.start()  # 12,100 bytes waiting, over the 10,000 bound: no room until sent
    outbox.sent(100)
    outbox.get()
    outbox.sent(6_000)
    waiter.join(10)
    assert rooms == [2]
    outbox.close()
    assert outbox.wait_for_room() == 0


def test_corrupt_stored_chunk(local_store):
    path = local_store.root / "chunks" / local_store.keys[3] / "L2.cgc"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    got, consume = collect()
    with ChunkServer(local_store, rate_mbps=1000) as server:
        with pytest.raises(ChunkCorrupt):
            stream_load(SocketSource(server.address), local_store.keys, decode, consume, level=2)
    assert [i for i, _ in got] == [0, 1, 2]


def test_redis_stopped_mid_stream(redis_server, redis_url):
    store = open_store(redis_url + "?timeout_s=2")
    blobs = [os.urandom(1_000_000) for _ in range(24)]
    keys = [f"ns/r{i:03d}" for i in range(len(blobs))]
    for k, blob in zip(keys, blobs):
        store.put(k, 2, blob)
    got = []

    def consume(i, blob):
        got.append(blob)
        if i == 1:
            redis_server.stop()

    try:
        # At 100 Mbit/s the server reads chunks from redis at most four ahead of the link
        # (DEFAULT_PREFETCH), so most chunks are still in redis when it stops.
        with ChunkServer(store, rate_mbps=100) as server:
            with pytest.raises(StoreUnavailable) as info:
                stream_load(
                    SocketSource(server.address), keys, bytes, consume, level=2, stall_timeout_s=10
                )
    finally:
        redis_server.start()
    n = info.value.stats.n_loaded
    assert 2 <= n < len(blobs) and got == blobs[:n]


class RawServer:
    """A real TCP peer that answers the first request with ``reply(request_key)`` bytes and then
    keeps the connection open without sending more (a stalled or misbehaving server)."""

    def __init__(self, reply, close_after: bool = False):
        self.reply, self.close_after = reply, close_after
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.sock.accept()
        with conn:
            head = protocol.recv_exact(conn, protocol.REQUEST.size, "req")
            _, rid, level, key_len = protocol.REQUEST.unpack(head)
            key = protocol.recv_exact(conn, key_len, "key").decode()
            conn.sendall(self.reply(rid, key, level))
            if not self.close_after:
                self.release.wait(30)

    def close(self):
        self.release.set()
        self.sock.close()
        self.thread.join(5)


def _response(rid, key, level, payload: bytes, cut: int = 0, flip: bool = False) -> bytes:
    rec = bytearray(record.pack(key, level, payload))
    if flip:
        rec[-1] ^= 0xFF
    return protocol.pack_response_header(rid, protocol.OK, len(rec)) + bytes(rec[: len(rec) - cut])


def test_stalled_socket_times_out():
    server = RawServer(lambda rid, key, lv: _response(rid, key, lv, b"x" * 100_000, cut=50_000))
    got, consume = collect()
    start = time.monotonic()
    try:
        with pytest.raises(StreamTimeout, match="stalled"):
            stream_load(SocketSource(server.sock.getsockname()), ["ns/a", "ns/b"], len, consume,
                        level=0, stall_timeout_s=0.5)  # fmt: skip
    finally:
        server.close()
    assert got == []
    assert time.monotonic() - start < 10  # it did not hang (the timeout is 0.5 s)


@pytest.mark.parametrize(
    "size,damage,close_after,error,match",
    [
        (100_000, {"cut": 1}, True, StreamProtocolError, "closed after"),
        (10_000, {"flip": True}, False, ChunkCorrupt, "checksum"),
    ],
    ids=["connection-cut-mid-chunk", "corruption-in-transit"],
)
def test_a_damaged_response_is_detected(size, damage, close_after, error, match):
    server = RawServer(
        lambda rid, key, lv: _response(rid, key, lv, b"x" * size, **damage),
        close_after=close_after,
    )
    try:
        with pytest.raises(error, match=match):
            stream_load(
                SocketSource(server.sock.getsockname()), ["ns/a"], len, lambda i, x: None, level=0
            )
    finally:
        server.close()


def test_deadline(local_store):
    with ChunkServer(local_store, rate_mbps=1) as server:  # 12 chunks take seconds at 1 Mbit/s
        with pytest.raises(StreamTimeout, match="deadline"):
            stream_load(
                SocketSource(server.address),
                local_store.keys,
                len,
                lambda i, x: None,
                level=2,
                timeout_s=0.3,
            )


def test_consumer_error_stops_the_fetcher(local_store):
    before = threading.active_count()

    def consume(i, x):
        if i == 2:
            raise RuntimeError("injection failed")

    with ChunkServer(local_store, rate_mbps=100) as server:
        with pytest.raises(RuntimeError, match="injection failed"):
            stream_load(SocketSource(server.address), local_store.keys, len, consume, level=2)
    assert threading.active_count() == before


# ---- adaptive controller ---------------------------------------------------------------

SIZES = {0: [100_000] * 10, 1: [200_000] * 10, 2: [400_000] * 10}


def make_controller(slo_s, prefill_tps=10_000.0, **kw):
    return AdaptiveController(
        slo_s, SIZES, [100] * 10, prefill_tokens_per_s=prefill_tps, drop_factor=1.0, **kw
    )


def test_controller_picks_best_level_that_fits():
    c = make_controller(1.0, prefill_tps=20_000.0)
    assert c.choose(0, 0.0) == 0  # no throughput known yet: the cheapest level
    c.observe_throughput(10_000_000, 1.0)  # 10 MB/s: chunks 1-9 take 0.09 / 0.18 / 0.36 s
    assert c.choose(1, 0.0) == 2
    assert c.choose(1, 0.75) == 1  # 0.25 s left
    assert c.choose(1, 0.88) == 0  # 0.12 s left
    assert c.choose(1, 0.95) == RECOMPUTE  # 0.05 s left: 900 tokens at 20k tok/s take 0.045 s
    assert [d.choice for d in c.decisions] == [0, 2, 1, 0, RECOMPUTE]
    assert c.decisions[1].predicted_s == pytest.approx(0.36)


def test_controller_orders_levels_by_size_not_by_number():
    """Calibrated levels are numbered after the paper's: level 6 may be coarser than level 4."""
    sizes = {1: [100_000] * 10, 4: [400_000] * 10, 6: [200_000] * 10, 9: [None] * 10}
    c = AdaptiveController(1.0, sizes, [100] * 10, prefill_tokens_per_s=20_000.0, drop_factor=1.0)
    assert c.levels == [1, 6, 4, 9]
    c.observe_throughput(10_000_000, 1.0)
    assert c.choose(1, 0.0) == 4  # the biggest (finest) level that fits
    assert c.choose(1, 0.75) == 6  # 0.25 s left: level 6 (0.18 s) fits, level 4 (0.36 s) does not
    assert c.choose(1, 0.88) == 1


def test_controller_when_nothing_fits():
    c = make_controller(0.5, prefill_tps=100_000.0)
    c.observe_throughput(10_000, 1.0)  # 10 kB/s: 7 chunks at level 0 take 70 s
    assert c.choose(3, 0.1) == RECOMPUTE  # 700 tokens at 100k tok/s take 7 ms
    slow = make_controller(0.5, prefill_tps=1.0)
    slow.observe_throughput(10_000, 1.0)
    assert slow.choose(3, 0.1) == 0  # neither fits: level 0 (70 s) is faster than text (700 s)


def test_controller_accounts_for_decode_time():
    blind = make_controller(1.0)
    aware = make_controller(1.0, decode_s_per_token={0: 1e-6, 1: 2e-3, 2: 4e-3})
    for c in (blind, aware):
        c.observe_throughput(100_000_000, 1.0)  # transfer takes at most 36 ms
    assert blind.choose(1, 0.0) == 2
    assert aware.choose(1, 0.0) == 0  # 900 tokens decode in 1.8 s at level 1, 3.6 s at level 2
    aware.observe_decode(1, 0.0001)  # level 0 measured: the priors of the others are kept
    assert aware.decode_spt == {0: pytest.approx(1e-6), 1: 2e-3, 2: 4e-3}


def test_controller_counts_the_decode_backlog():
    c = make_controller(0.5, decode_s_per_token={0: 1e-4, 1: 2e-4, 2: 4e-4})
    c.observe_throughput(1_000_000_000, 1.0)  # the link is fast; decoding is the bottleneck
    assert [c.choose(i, 0.0) for i in range(3)] == [2, 2, 2]  # 10 x 40 ms = 0.4 s fits
    # Nothing decoded yet: 3 chunks (0.12 s) wait for the decoder, so at 0.2 s only
    # 0.12 + 7 x 20 ms = 0.26 s fits the 0.3 s left, and 0.12 + 7 x 40 ms = 0.40 s does not.
    assert c.choose(3, 0.2) == 1
    for i in range(4):
        c.observe_decode(i, 0.0)  # the decoder caught up (instantly, say)
    assert c.choose(4, 0.2) == 2  # 6 x 40 ms = 0.24 s


def test_recoverability_rule():
    greedy = make_controller(1.0, prefill_tps=1.0)
    careful = AdaptiveController(1.0, SIZES, [100] * 10, prefill_tokens_per_s=1.0, drop_factor=2.0)
    for c in (greedy, careful):
        c.observe_throughput(10_000_000, 1.0)
    # 0.19 s left. Level 1 needs 0.18 s at 10 MB/s. At half the rate, chunk 1 at level 1 plus
    # chunks 2-9 at level 0 need 0.04 + 0.16 = 0.20 s: not recoverable. Level 0: 0.18 s.
    assert greedy.choose(1, 0.81) == 1
    assert careful.choose(1, 0.81) == 0
    assert careful.choose(1, 0.0) == 2  # with room to spare both agree


def test_adaptive_load_over_socket(local_store, chunks):
    sizes = {lv: local_store.sizes(local_store.keys, lv) for lv in LEVELS}
    tokens = [TOKENS] * N_CHUNKS
    with open_link(local_store, bandwidth_mbps=200) as link:
        relaxed = AdaptiveController(1000.0, sizes, tokens, prefill_tokens_per_s=1.0)
        got, consume = collect()
        stats = stream_load(link.source, local_store.keys, decode, consume, controller=relaxed)
        # an hour of budget: every chunk after the first goes at the best level
        assert stats.levels == [0] + [2] * (N_CHUNKS - 1)
        assert all(same_kv(kv, decode(chunks[(i, stats.levels[i])])) for i, kv in got)
        assert len(stats.decisions) == N_CHUNKS

        hopeless = AdaptiveController(
            1e-6, sizes, tokens, prefill_tokens_per_s=1e12, initial_mbps=1.0
        )
        got, consume = collect()
        stats = stream_load(link.source, local_store.keys, decode, consume, controller=hopeless)
        assert stats.recompute_from == 0 and stats.n_loaded == 0 and got == []
        assert stats.levels == [RECOMPUTE] * N_CHUNKS


# ---- netns + tc ------------------------------------------------------------------------


@pytest.mark.skipif(netns.unavailable_reason() is not None, reason=netns.unavailable_reason() or "")
def test_netns_shaper_shapes_and_cleans_up(local_store):
    with open_link(local_store, bandwidth_mbps=100, shaper="netns") as link:
        name = link.netns.name
        assert "tbf" in link.describe()["qdisc"]
        stats = stream_load(link.source, local_store.keys, len, lambda i, x: None, level=2)
        burst = link.netns.burst_bytes
    assert stats.n_loaded == N_CHUNKS
    assert stats.transfer_s >= (stats.bytes - burst) * 8 / 100e6
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed


def test_netns_reports_why_it_cannot_run(local_store, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(Exception, match="needs root"):
        with open_link(local_store, bandwidth_mbps=100, shaper="netns"):
            pass
