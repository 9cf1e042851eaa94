"""Streaming over real TCP sockets: traces, shaping, the chunk server, failures, netns."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time

import pytest

from cachegen.modes import Form
from cachegen.store import (
    SLIDING,
    ChunkCorrupt,
    ChunkMissing,
    RecordAddress,
    StoreUnavailable,
    open_store,
    record,
)
from cachegen.stream import (
    RECOMPUTE,
    AdaptiveController,
    DirectSource,
    StreamProtocolError,
    StreamTimeout,
    stream_load,
)
from cachegen_lab.network import (
    BandwidthTrace,
    ChunkServer,
    SocketSource,
    netns,
    open_link,
    protocol,
)
from cachegen_lab.network import server as server_module
from cachegen_lab.network.ratelimit import TokenBucket
from tests.stream.chunks_support import (
    LEVELS,
    N_CHUNKS,
    TOKENS,
    collect,
    decode,
    label,
    records,
    same_kv,
)

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
            SocketSource(server.address), records(local_store.keys, 1), decode, consume
        )
    assert [i for i, _ in got] == list(range(N_CHUNKS))
    assert all(same_kv(kv, decode(chunks[(i, 1)])) for i, kv in got)
    assert stats.n_loaded == N_CHUNKS and stats.recompute_from is None
    assert stats.forms == [label(1)] * N_CHUNKS
    assert stats.bytes == sum(len(chunks[(i, 1)]) for i in range(N_CHUNKS))
    assert stats.load_s >= stats.transfer_s > 0 and stats.goodput_mbps > 0
    if rate:  # the kernel cannot deliver faster than the server's bucket lets bytes out
        burst = server.bucket.burst
        assert stats.transfer_s >= (stats.bytes - burst) * 8 / (rate * 1e6)


def test_shared_link_serves_concurrent_loads(local_store):
    with open_link(local_store, bandwidth_mbps=500) as link:
        results = []
        threads = [
            threading.Thread(target=lambda: results.append(stream_load(link.source,
                records(local_store.keys, 2), len, lambda i, x: None)))
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
        stream_load(link.source, records(keys, 1), decode, consume)
    assert all(same_kv(kv, decode(chunks[(i, 1)])) for i, kv in got) and len(got) == 4


# ---- failures end in typed errors, never in partial chunks -----------------------------


def test_missing_chunk_mid_stream(local_store, chunks):
    local_store.delete(local_store.keys[5], 1)
    got, consume = collect()
    with ChunkServer(local_store) as server:
        with pytest.raises(ChunkMissing) as info:
            stream_load(SocketSource(server.address), records(local_store.keys, 1), decode, consume)
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
        stats = stream_load(source, records(store.keys, 2), decode, consume)
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
            stream_load(source, records(redis_chunks.keys, 1), decode, consume)
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
        stream_load(SocketSource(server.address), records(local_store.keys, 2), decode, consume)
    assert [i for i, _ in got] == list(range(N_CHUNKS))
    assert batches[0] == 1 and sum(batches) == N_CHUNKS and max(batches) <= 3


def test_a_request_names_a_record_by_its_address():
    """Chunk key, part and form name travel as text; the server rebuilds the address."""
    address = RecordAddress.of("ns/chunk000", "cachegen-11-packed", SLIDING)
    frame = protocol.pack_request(7, address)
    magic, rid, key_len, part_len, form_len = protocol.REQUEST.unpack_from(frame)
    body = frame[protocol.REQUEST.size :]
    assert (magic, rid) == (protocol.REQUEST_MAGIC, 7)
    assert body == b"ns/chunk000" + b"sliding" + b"cachegen-11-packed"
    key, part = body[:key_len], body[key_len : key_len + part_len]
    assert protocol.unpack_address(key, part, body[key_len + part_len :]) == address
    whole = RecordAddress.of("ns/chunk000", "int8")
    assert protocol.pack_request(0, whole).endswith(b"ns/chunk000int8")  # no part: empty


def test_a_request_that_names_no_record_fails_alone(local_store, chunks):
    """A form no codec has gets an error response; the connection serves the next request."""
    with ChunkServer(local_store) as server:
        sock = socket.create_connection(server.address)
        try:
            key, form = local_store.keys[0].encode(), b"cachegen-x"
            head = protocol.REQUEST.pack(protocol.REQUEST_MAGIC, 0, len(key), 0, len(form))
            good = protocol.pack_request(1, records(local_store.keys[:1], 1)[0])
            sock.sendall(head + key + form + good)
            first = protocol.recv_exact(sock, protocol.RESPONSE.size, "response")
            _, rid, status, length = protocol.RESPONSE.unpack(first)
            message = protocol.recv_exact(sock, length, "message").decode()
            assert (rid, status) == (0, protocol.ERROR) and "unknown form 'cachegen-x'" in message
            _, rid, status, length = protocol.RESPONSE.unpack(
                protocol.recv_exact(sock, protocol.RESPONSE.size, "response")
            )
            body = protocol.recv_exact(sock, length, "record")
            assert (rid, status) == (1, protocol.OK)
            assert record.unpack(body, local_store.keys[0], 1) == chunks[(0, 1)]
        finally:
            sock.close()


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
            stream_load(SocketSource(server.address), records(local_store.keys, 2), decode, consume)
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
                    SocketSource(server.address),
                    records(keys, 2),
                    bytes,
                    consume,
                    stall_timeout_s=10,
                )
    finally:
        redis_server.start()
    n = info.value.stats.n_loaded
    assert 2 <= n < len(blobs) and got == blobs[:n]


class RawServer:
    """A real TCP peer that answers the first request with ``reply(id, address)`` bytes and then
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
            _, rid, key_len, part_len, form_len = protocol.REQUEST.unpack(head)
            raw = protocol.recv_exact(conn, key_len + part_len + form_len, "address")
            address = protocol.unpack_address(
                raw[:key_len], raw[key_len : key_len + part_len], raw[key_len + part_len :]
            )
            conn.sendall(self.reply(rid, address))
            if not self.close_after:
                self.release.wait(30)

    def close(self):
        self.release.set()
        self.sock.close()
        self.thread.join(5)


def _response(rid, address, payload: bytes, cut: int = 0, flip: bool = False) -> bytes:
    rec = bytearray(record.pack_at(address, payload))
    if flip:
        rec[-1] ^= 0xFF
    return protocol.pack_response_header(rid, protocol.OK, len(rec)) + bytes(rec[: len(rec) - cut])


def test_stalled_socket_times_out():
    server = RawServer(lambda rid, address: _response(rid, address, b"x" * 100_000, cut=50_000))
    got, consume = collect()
    start = time.monotonic()
    try:
        with pytest.raises(StreamTimeout, match="stalled"):
            stream_load(SocketSource(server.sock.getsockname()), records(["ns/a", "ns/b"], 0),
                        len, consume, stall_timeout_s=0.5)  # fmt: skip
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
        lambda rid, address: _response(rid, address, b"x" * size, **damage),
        close_after=close_after,
    )
    try:
        with pytest.raises(error, match=match):
            stream_load(
                SocketSource(server.sock.getsockname()),
                records(["ns/a"], 0),
                len,
                lambda i, x: None,
            )
    finally:
        server.close()


def test_deadline(local_store):
    with ChunkServer(local_store, rate_mbps=1) as server:  # 12 chunks take seconds at 1 Mbit/s
        with pytest.raises(StreamTimeout, match="deadline"):
            stream_load(
                SocketSource(server.address),
                records(local_store.keys, 2),
                len,
                lambda i, x: None,
                timeout_s=0.3,
            )


def test_consumer_error_stops_the_fetcher(local_store):
    before = threading.active_count()

    def consume(i, x):
        if i == 2:
            raise RuntimeError("injection failed")

    with ChunkServer(local_store, rate_mbps=100) as server:
        with pytest.raises(RuntimeError, match="injection failed"):
            stream_load(SocketSource(server.address), records(local_store.keys, 2), len, consume)
    assert threading.active_count() == before


def test_adaptive_load_over_socket(local_store, chunks):
    sizes = {lv: local_store.sizes(local_store.keys, lv) for lv in LEVELS}
    tokens = [TOKENS] * N_CHUNKS
    with open_link(local_store, bandwidth_mbps=200) as link:
        relaxed = AdaptiveController(1000.0, sizes, tokens, prefill_tokens_per_s=1.0)
        got, consume = collect()
        loads = records(local_store.keys, 0)
        stats = stream_load(link.source, loads, decode, consume, controller=relaxed)
        # an hour of budget: every chunk after the first goes at the best level
        assert stats.forms == [label(0)] + [label(2)] * (N_CHUNKS - 1)
        levels = [Form.parse(f).level for f in stats.forms]
        assert all(same_kv(kv, decode(chunks[(i, levels[i])])) for i, kv in got)
        assert len(stats.decisions) == N_CHUNKS

        hopeless = AdaptiveController(
            1e-6, sizes, tokens, prefill_tokens_per_s=1e12, initial_mbps=1.0
        )
        got, consume = collect()
        stats = stream_load(link.source, loads, decode, consume, controller=hopeless)
        assert stats.recompute_from == 0 and stats.n_loaded == 0 and got == []
        assert stats.forms == [RECOMPUTE] * N_CHUNKS


# ---- netns + tc ------------------------------------------------------------------------


@pytest.mark.skipif(netns.unavailable_reason() is not None, reason=netns.unavailable_reason() or "")
def test_netns_shaper_shapes_and_cleans_up(local_store):
    with open_link(local_store, bandwidth_mbps=100, shaper="netns") as link:
        name = link.netns.name
        assert "tbf" in link.describe()["qdisc"]
        stats = stream_load(link.source, records(local_store.keys, 2), len, lambda i, x: None)
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
