"""Chunk keys and both chunk-store backends (local directory, real redis-server)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import time

import pytest
import redis
import torch

from cachegen.kv import ModelIdentity
from cachegen.models import ServedWeights
from cachegen.store import (
    ChunkCorrupt,
    ChunkMissing,
    ChunkTooLarge,
    RecordAddress,
    StoreConfigError,
    StoreError,
    StoreUnavailable,
    chunk_keys,
    open_store,
    parse_size,
    record,
    stored_prefix,
)
from cachegen.store.local import LocalStore
from tests.support import REPO, free_cluster_port, require_tool

MODEL = ModelIdentity("m", "f" * 64, num_layers=2, num_kv_heads=1, head_dim=64)
OTHER = ModelIdentity("m", "e" * 64, num_layers=2, num_kv_heads=1, head_dim=64)
WEIGHTS = ServedWeights("f" * 64)  # a model directory served as it is


# ---- keys ------------------------------------------------------------------------------


def test_keys_chain_over_the_prefix():
    tokens = list(range(1000))
    keys = chunk_keys(MODEL, "cachegen-v1", tokens, 256, weights=WEIGHTS)
    assert len(keys) == 4  # three full chunks and the 232-token tail
    assert (
        chunk_keys(MODEL, "cachegen-v1", torch.tensor(tokens[:512]), 256, weights=WEIGHTS)
        == keys[:2]
    )
    changed = tokens.copy()
    changed[300] = 7  # chunk 1 changes, so every key from chunk 1 on changes
    other = chunk_keys(MODEL, "cachegen-v1", changed, 256, weights=WEIGHTS)
    assert other[0] == keys[0] and all(a != b for a, b in zip(other[1:], keys[1:]))
    assert (
        len(chunk_keys(MODEL, "cachegen-v1", tokens, 256, include_partial=False, weights=WEIGHTS))
        == 3
    )


def test_keys_are_namespaced_by_model_weights_codec_and_chunking():
    tokens = list(range(512))
    base = chunk_keys(MODEL, "p1", tokens, 256, weights=WEIGHTS)
    for other in (
        chunk_keys(OTHER, "p1", tokens, 256, weights=WEIGHTS),
        chunk_keys(MODEL, "p2", tokens, 256, weights=WEIGHTS),
        chunk_keys(MODEL, "p1", tokens, 128, weights=WEIGHTS)[:2],
        chunk_keys(MODEL, "p1", tokens, 256, weights=ServedWeights("e" * 64)),
    ):
        assert not set(base) & set(other)
    assert len({k.split("/")[0] for k in base}) == 1


@pytest.mark.parametrize(
    "bad", ["../etc/passwd", "a/b/c", "nohash", "a/b c", "", "a/" + "x" * 200, "ns/k\n"]
)
def test_unsafe_keys_are_rejected(tmp_path, bad):
    s = open_store(str(tmp_path / "s"))
    with pytest.raises(StoreConfigError, match="invalid chunk key"):
        s.put(bad, 0, b"x")


# ---- both backends ---------------------------------------------------------------------


def test_round_trip(store):
    keys = chunk_keys(MODEL, "p", list(range(600)), 256, weights=WEIGHTS)
    blobs = {(k, lv): os.urandom(1000 + 10 * lv + i) for i, k in enumerate(keys) for lv in (1, 3)}
    for (k, lv), blob in blobs.items():
        store.put(k, lv, blob)
    for (k, lv), blob in blobs.items():
        assert store.get(k, lv) == blob
        assert b"".join(store.get_stream(k, lv, block_size=333)) == blob
    assert store.levels(keys[0]) == [1, 3]
    assert store.exists(keys[1], 3) and not store.exists(keys[1], 2)
    assert store.sizes(keys, 1) == [len(blobs[(k, 1)]) for k in keys]
    assert store.sizes(keys, 2) == [None] * 3
    store.put(keys[0], 1, b"replaced")
    assert store.get(keys[0], 1) == b"replaced"
    entries = sorted((e.key, e.level, e.size) for e in store.list())
    assert len(entries) == 6 and (keys[0], 1, len(b"replaced")) in entries
    stats = store.stats()
    assert (stats.chunks, stats.entries) == (3, 6)
    assert store.delete(keys[2], 3) == 1 and store.levels(keys[2]) == [1]
    assert store.delete(keys[2]) == 1 and store.levels(keys[2]) == []
    with pytest.raises(ChunkMissing):
        store.get(keys[2], 1)
    with pytest.raises(ChunkMissing):
        list(store.get_stream(keys[2], 1))


def needed(keys, *levels: int) -> list[list[RecordAddress]]:
    """Per chunk of ``keys``, its records at the cachegen ``levels``."""
    return [[RecordAddress.of(k, f"cachegen-{lv}") for lv in levels] for k in keys]


def test_stored_prefix(store):
    keys = chunk_keys(MODEL, "p", list(range(256 * 6)), 256, weights=WEIGHTS)
    for k in keys[:4]:
        store.put(k, 0, b"low")
    for k in keys[:2] + keys[3:4]:
        store.put(k, 2, b"high")
    assert stored_prefix(store, needed(keys, 0)) == 4
    assert stored_prefix(store, needed(keys, 0, 2)) == 2  # chunk 2 lacks level 2
    assert stored_prefix(store, needed(keys, 5)) == 0
    store.put(keys[5], 0, b"orphan")  # beyond a gap: not part of the prefix
    assert stored_prefix(store, needed(keys, 0)) == 4


def test_evict_least_recently_used(store):
    keys = [f"ns/k{i}" for i in range(5)]
    for k in keys:
        store.put(k, 0, b"x" * 1000)
        time.sleep(0.01)  # distinct LRU clocks; redis idletime has 1 s resolution, so
    store.get(keys[0], 0)  # only the local backend is checked for order
    removed = store.evict(2500)
    assert removed == 3
    left = {e.key for e in store.list()}
    assert len(left) == 2
    if isinstance(store, LocalStore):
        assert keys[0] in left and keys[4] in left
    assert store.evict(0) == 2 and list(store.list()) == []


def test_damaged_record_is_never_returned(store, tmp_path):
    key = "ns/damaged"
    store.put(key, 1, b"A" * 5000)
    good = store.get_record(key, 1)
    bad = bytearray(good)
    bad[record.HEADER_SIZE + 100] ^= 0xFF
    _overwrite(store, key, 1, bytes(bad))
    with pytest.raises(ChunkCorrupt, match="checksum"):
        store.get(key, 1)
    with pytest.raises(ChunkCorrupt):
        list(store.get_stream(key, 1, block_size=1024))
    _overwrite(store, key, 1, good[:-10])  # truncated
    with pytest.raises(ChunkCorrupt):
        store.get(key, 1)
    store.put("ns/other", 1, b"A" * 5000)  # a record moved under another key
    _overwrite(store, key, 1, store.get_record("ns/other", 1))
    with pytest.raises(ChunkCorrupt, match="another key"):
        store.get(key, 1)


def _overwrite(store, key: str, level: int, data: bytes) -> None:
    if isinstance(store, LocalStore):
        (store.root / "chunks" / key / f"L{level}.cgc").write_bytes(data)
    else:
        store._r.set(store._name(key, level), data)


def test_concurrent_writers_and_readers(store):
    """Readers see one of the complete versions, never a mix or a partial chunk."""
    key = "ns/contended"
    versions = [bytes([v]) * (200_000 + v) for v in range(4)]
    store.put(key, 0, versions[0])
    errors: list[BaseException] = []
    stop = threading.Event()

    def write(v: int) -> None:
        try:
            while not stop.is_set():
                store.put(key, 0, versions[v])
        except BaseException as exc:
            errors.append(exc)

    def read() -> None:
        try:
            for _ in range(60):
                assert store.get(key, 0) in versions
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(v,)) for v in range(4)]
    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in writers + readers:
        t.start()
    for t in readers:
        t.join()
    stop.set()
    for t in writers:
        t.join()
    assert not errors


# ---- local backend ---------------------------------------------------------------------


def test_local_capacity_evicts_on_put(tmp_path):
    s = open_store((tmp_path / "s").as_uri() + "?max_bytes=10kb")
    for i in range(20):
        s.put(f"ns/k{i:02d}", 0, b"y" * 1000)
        time.sleep(0.002)
    total = s.stats().payload_bytes
    assert total <= 10_000
    assert s.exists("ns/k19", 0) and not s.exists("ns/k00", 0)
    with pytest.raises(StoreError, match="capacity"):
        s.put("ns/huge", 0, b"z" * 20_000)


def test_local_refuses_foreign_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(StoreConfigError, match="not a cachegen chunk store"):
        open_store(str(tmp_path))


def test_a_store_another_process_is_creating_opens(tmp_path):
    """Its directories exist and its marker does not yet (every TP rank opens the store at
    start-up): that is not a foreign directory."""
    (tmp_path / "chunks").mkdir()
    (tmp_path / "tmp").mkdir()
    store = open_store(str(tmp_path))
    store.put("ns/k", 0, b"x")
    assert open_store(str(tmp_path)).get("ns/k", 0) == b"x"
    (tmp_path / "other").mkdir()
    assert open_store(str(tmp_path)).exists("ns/k", 0)  # the marker is there now


def test_local_concurrent_processes(tmp_path):
    """Two processes write and read the same keys; every read is a complete version."""
    url = (tmp_path / "s").as_uri()
    script = (
        "import sys, os\n"
        "from cachegen.store import open_store\n"
        "s = open_store(sys.argv[1]); tag = sys.argv[2].encode()\n"
        "for i in range(200):\n"
        "    s.put('ns/shared', 0, tag * 50000)\n"
        "    b = s.get('ns/shared', 0)\n"
        "    assert b in (b'a' * 50000, b'b' * 50000), len(b)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([os.sys.executable, "-c", script, url, tag], env=env) for tag in "ab"]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert list((tmp_path / "s" / "tmp").iterdir()) == []  # no temp files left behind


# ---- redis backend ---------------------------------------------------------------------


# ---- reading many chunks at once (what the chunk server fetches ahead with) ------------


def _get_many_cases(store) -> tuple[list, list]:
    """Stored chunks with a missing one, a damaged one and an unsafe key among them: the
    pairs to ask for and what each must come back as (bytes, or an error type)."""
    keys = chunk_keys(MODEL, "p", list(range(256 * 6)), 256, weights=WEIGHTS)
    blobs = [os.urandom(3000 + i) for i in range(len(keys))]
    for key, blob in zip(keys, blobs):
        store.put(key, 2, blob)
    store.delete(keys[2], 2)
    damaged = bytearray(store.get_record(keys[4], 2))
    damaged[-1] ^= 0x01
    _overwrite(store, keys[4], 2, bytes(damaged))
    items = [(k, 2) for k in keys] + [("../etc/passwd", 2), (keys[0], 7), (keys[1], 2)]
    want = [blobs[0], blobs[1], ChunkMissing, blobs[3], ChunkCorrupt, blobs[5]]
    want += [StoreConfigError, ChunkMissing, blobs[1]]
    return items, want


def _check_many(got: list, want: list) -> None:
    assert len(got) == len(want)
    for found, expected in zip(got, want):
        if isinstance(expected, bytes):
            assert found == expected
        else:
            assert isinstance(found, expected), (found, expected)


def test_get_many_matches_get_pair_by_pair(store):
    items, want = _get_many_cases(store)
    _check_many(store.get_many(items), want)
    records = store.get_records(items)
    for (key, level), found in zip(items, records):
        if isinstance(found, bytes):
            assert found == store.get_record(key, level)
    assert store.get_many([]) == [] and store.get_records([]) == []


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_get_records_refuses_records_over_the_cap(backend, tmp_path, request):
    url = (
        (tmp_path / "capped").as_uri()
        if backend == "local"
        else request.getfixturevalue("redis_url")
    )
    with open_store(url + ("&" if "?" in url else "?") + "max_record_bytes=4096") as s:
        s.put("ns/small", 0, b"s" * 1000)
        s.put("ns/big", 0, b"b")
        _overwrite(s, "ns/big", 0, record.pack("ns/big", 0, b"b" * 10_000))  # a bigger writer
        small, big, missing = s.get_many([("ns/small", 0), ("ns/big", 0), ("ns/none", 0)])
    assert small == b"s" * 1000
    assert isinstance(big, ChunkTooLarge) and isinstance(missing, ChunkMissing)


@pytest.fixture
def stopped_redis_store(redis_server):
    """A store that wrote ``ns/a`` to a redis-server that has stopped since; the server is
    started again afterwards."""
    if redis_server.proc is None:
        redis_server.start()
    s = open_store(redis_server.url + "?timeout_s=2")
    s.put("ns/a", 0, b"x")
    redis_server.stop()
    try:
        yield s
    finally:
        redis_server.start()


def test_get_many_with_redis_stopped_fails_every_pair(stopped_redis_store):
    got = stopped_redis_store.get_many([("ns/a", 0), ("ns/b", 0)])
    assert all(isinstance(found, StoreUnavailable) for found in got)


def test_redis_ttl(redis_url):
    """Chunks expire after ttl_s; the store's other records never do (tests/store/
    test_redis_memory.py checks max_memory, which sets nothing on the server)."""
    s = open_store(redis_url + "?ttl_s=120&prefix=t1")
    s.put("ns/ttl", 0, b"v")
    tables_id = hashlib.sha256(b"tables").hexdigest()[:32]
    s.put_tables(tables_id, b"tables")
    r = redis.Redis.from_url(redis_url)
    assert 0 < r.ttl("t1:{ns/ttl}:L0") <= 120
    assert r.ttl(f"t1:tables:{tables_id}") == -1  # no TTL: a volatile-* policy never evicts it


def test_redis_stopped_raises_unavailable(stopped_redis_store):
    s = stopped_redis_store
    for op in (
        lambda: s.get("ns/a", 0),
        lambda: s.put("ns/a", 0, b"y"),
        lambda: s.exists("ns/a", 0),
    ):
        with pytest.raises(StoreUnavailable):
            op()


def test_redis_cluster_single_node(tmp_path):
    """The cluster client path against a real one-node Redis Cluster owning every slot."""
    port = free_cluster_port()
    proc = subprocess.Popen(
        [require_tool("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--cluster-enabled", "yes",
         "--cluster-config-file", str(tmp_path / "nodes.conf"), "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        r = _wait_for_redis(port)
        r.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        for _ in range(100):
            if b"cluster_state:ok" in r.execute_command("CLUSTER", "INFO"):
                break
            time.sleep(0.05)
        s = open_store(f"redis+cluster://127.0.0.1:{port}")
        keys = chunk_keys(MODEL, "p", list(range(768)), 256, weights=WEIGHTS)
        for k in keys[:2]:
            s.put(k, 1, b"cluster-" + k.encode())
        assert s.get(keys[1], 1) == b"cluster-" + keys[1].encode()
        assert stored_prefix(s, needed(keys, 1)) == 2
        assert {e.key for e in s.list()} == set(keys[:2])
        items, want = _get_many_cases(s)
        _check_many(s.get_many(items), want)
        s.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _wait_for_redis(port: int) -> redis.Redis:
    # Socket timeouts bound each try: a server that accepts but never answers must fail the
    # test, not hang it.
    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            r.ping()
            return r
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            time.sleep(0.05)
    raise AssertionError(f"redis-server on port {port} did not start")


# ---- URLs ------------------------------------------------------------------------------


def test_open_store_urls(tmp_path, redis_url):
    assert isinstance(open_store(str(tmp_path / "plain")), LocalStore)
    local = open_store((tmp_path / "opt").as_uri() + "?max_bytes=1MiB&fsync=1")
    assert local.max_bytes == 2**20 and local.fsync
    assert open_store(redis_url.replace("redis://", "valkey://")).exists("ns/x", 0) is False
    with pytest.raises(StoreConfigError, match="scheme"):
        open_store("ftp://host/x")
    with pytest.raises(StoreConfigError, match="unknown"):
        open_store((tmp_path / "o2").as_uri() + "?colour=blue")
    with pytest.raises(StoreConfigError, match="not a valid"):
        open_store(redis_url + "?ttl_s=soon")
    assert parse_size("2gb") == 2_000_000_000 and parse_size("1GiB") == 2**30
    with pytest.raises(StoreConfigError):
        parse_size("lots")


def test_directory_store_marker_is_versioned(tmp_path):
    import json

    from cachegen.store.local import MARKER

    root = tmp_path / "s"
    open_store(root.as_uri()).close()
    marker = root / MARKER
    assert json.loads(marker.read_text()) == {"schema": "cachegen-chunk-store", "version": 1}
    marker.write_text(json.dumps({"format": "cachegen-chunk-store", "version": 1}))
    open_store(root.as_uri()).close()  # stores made before the marker said "schema"
    marker.write_text(json.dumps({"schema": "cachegen-chunk-store", "version": 7}))
    with pytest.raises(StoreConfigError, match="version 7"):
        open_store(root.as_uri())
