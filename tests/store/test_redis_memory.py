"""Redis without surprises, against a real redis-server: the store never changes the server's
settings (``max_memory`` only checks them), and tables or a pointer the store lost are no hit
for a consumer that cannot get them, until the producer's next save puts them back."""

from __future__ import annotations

import shutil

import pytest
import redis
import torch

from cachegen.codec.cachegen.profile import profile_path
from cachegen.codec.coding import tables as tables_mod
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.transport import ChunkTransport
from cachegen.extract import extract_kv
from cachegen.profiles import ensure_profile
from cachegen.store import StoreConfigError, open_store

CHUNK = 64
MIB = 1 << 20


def _config_sets(client: redis.Redis) -> int:
    return client.info("commandstats").get("cmdstat_config|set", {}).get("calls", 0)


def _policy(client: redis.Redis) -> dict[str, str]:
    found = client.config_get("maxmemory*")
    return {name: found[name] for name in ("maxmemory", "maxmemory-policy")}


@pytest.fixture
def operator(redis_url):
    """A client of the shared redis-server for the test to act as its operator; the server's
    memory settings are put back afterwards."""
    client = redis.Redis.from_url(redis_url)
    before = _policy(client)
    try:
        yield client
    finally:
        client.config_set("maxmemory", before["maxmemory"])
        client.config_set("maxmemory-policy", before["maxmemory-policy"])
        client.close()


def test_max_memory_checks_the_server_and_never_configures_it(redis_url, operator):
    url = f"{redis_url}?ttl_s=120&max_memory=64mb"
    for policy, limit, refused in (
        ("noeviction", 0, "evicts nothing"),
        ("allkeys-lru", 64 * MIB, "may evict the codec tables"),
        ("volatile-lru", 0, "has no maxmemory"),
        ("volatile-lru", 128 * MIB, "more than max_memory"),
    ):
        operator.config_set("maxmemory-policy", policy)
        operator.config_set("maxmemory", limit)
        settings, sets = _policy(operator), _config_sets(operator)
        with pytest.raises(StoreConfigError, match=f"{refused}.*maxmemory-policy volatile-lru"):
            open_store(url)
        assert _policy(operator) == settings and _config_sets(operator) == sets

    operator.config_set("maxmemory", 32 * MIB)  # at most max_memory, volatile-lru: fine
    settings, sets = _policy(operator), _config_sets(operator)
    with open_store(url) as store:
        store.put("ns/ttl", 0, b"v")
        assert store.capacity_bytes == 64_000_000
    assert 0 < operator.ttl("cachegen:{ns/ttl}:L0") <= 120  # chunks are what may be evicted
    assert _policy(operator) == settings and _config_sets(operator) == sets
    with pytest.raises(StoreConfigError, match="max_memory needs ttl_s"):
        open_store(f"{redis_url}?max_memory=64mb")


# ---- lost tables and pointer -------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tiny_llama):
    """tiny-llama's profile as `cachegen profile build` made it in the user cache (once), and
    the files that hold it: its document and its tables."""
    profile = ensure_profile(tiny_llama)
    tables = [tables_mod.LOCAL.path(tables_id) for tables_id in profile.tables_ids.values()]
    return profile, profile_path(profile.model), tables


def _install(profiles, document, tables) -> None:
    """Copy a profile ``document`` and its ``tables`` files into the directory ``profiles``."""
    (profiles / document.parent.name).mkdir(parents=True)
    shutil.copy(document, profiles / document.parent.name / document.name)
    (profiles / "tables").mkdir()
    for path in tables:
        shutil.copy(path, profiles / "tables" / path.name)


def _transport(url: str, spec, **options) -> ChunkTransport:
    extra = {"store": url, "chunk_tokens": CHUNK, "save_modes": ["cachegen"]}
    config = ConnectorConfig.from_extra_config({**extra, "cachegen_levels": [2], **options})
    return ChunkTransport(config, spec, spec.identity())


def _machine(monkeypatch, profiles) -> None:
    """Act as the machine whose profile directory is ``profiles``, nothing in memory."""
    monkeypatch.setenv("CACHEGEN_PROFILE_DIR", str(profiles))
    tables_mod.forget_cached_tables()


def test_lost_tables_are_no_hit_until_the_producers_next_save_puts_them_back(
    tiny_llama, built, redis_url, operator, tmp_path, isolated_profiles, monkeypatch, caplog
):
    kv = extract_kv(tiny_llama, token_ids=torch.arange(3 * CHUNK))
    ids, model = kv.token_ids.tolist(), tiny_llama.identity()
    _, document, tables = built
    _install(isolated_profiles, document, tables)  # the producer machine: the whole profile
    consumer_dir = tmp_path / "consumer-profiles"
    _install(consumer_dir, document, [])  # the consumer machine: the document, no tables
    producer = _transport(redis_url, tiny_llama)
    consumer = _transport(redis_url, tiny_llama, profile_source="local")
    try:
        assert producer.save(ids, kv.slice(0, 2 * CHUNK), ["cachegen"]) > 0
        profile_id = producer.codec("cachegen").profile_id
        lost = operator.keys("cachegen:tables:*") + operator.keys("cachegen:adopted:*")
        assert len(lost) > 1 and operator.delete(*lost) == len(lost)  # behind its back

        _machine(monkeypatch, consumer_dir)
        options = RequestOptions(mode="cachegen")
        with caplog.at_level("WARNING", logger="cachegen.connector.codecs"):
            assert consumer.stored_chunks(ids, options) == 0
            assert consumer.loadable_tokens(ids, options) == 0
        assert "are not counted as hits: profile tables" in caplog.text
        assert "producer's next save" in caplog.text
        result = consumer.load(ids, 0, 2, options, [].append)
        assert result.chunks_loaded == 0 and result.error.startswith("TablesMissing: ")

        _machine(monkeypatch, isolated_profiles)
        caplog.clear()
        with caplog.at_level("WARNING", logger="cachegen.connector.codecs"):
            assert producer.save(ids, kv, ["cachegen"]) > 0  # chunk 2 is new
        assert "had lost profile tables" in caplog.text and "adopted record" in caplog.text
        with open_store(redis_url) as store:
            assert store.adopted_profile(model.fingerprint, "cachegen") == profile_id
            assert store.missing_records([("profiles", profile_id)]) == []

        _machine(monkeypatch, consumer_dir)
        assert consumer.stored_chunks(ids, options) == 3
        got: list = []
        result = consumer.load(ids, 0, 3, options, got.append)
        assert result.error is None and [c.start for c in got] == [0, CHUNK, 2 * CHUNK]
    finally:
        consumer.close()
        producer.close()
