"""Profile tables travel with the chunks: a store holds the tables its chunks name (by tables
id, checked, written once), and a consumer without them decodes from the store alone."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from cachegen.codec import CodecError, decode, inspect
from cachegen.codec.cachegen.profile import profile_document, profile_from_document
from cachegen.codec.coding import tables as tables_mod
from cachegen.codec.coding.bitstream import parse_header
from cachegen.codec.coding.tables import TablesRefused
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.transport import ChunkTransport
from cachegen.extract import extract_kv
from cachegen.kv import ModelIdentity
from cachegen.models import ServedWeights
from cachegen.profiles import codec_for, ensure_profile, transient_profile
from cachegen.store import (
    ChunkCorrupt,
    ChunkForged,
    ChunkTooLarge,
    StoreConfigError,
    chunk_keys,
    open_store,
    profile_records,
)
from cachegen.store.tables import StoreTables, publish_profile, publish_tables, resolve_profile
from tests.support import empty_cache_env

CHUNK = 64
MODEL = ModelIdentity("m", "f" * 64, num_layers=2, num_kv_heads=1, head_dim=64)
SECRET = "s" * 32


@pytest.fixture(scope="module")
def tiny_kv(tiny_llama):
    return extract_kv(tiny_llama, token_ids=torch.arange(2 * CHUNK))


@pytest.fixture(scope="module")
def tiny_tables(tiny_llama) -> tuple[str, bytes]:
    """The id and file bytes of tiny-llama's level 2 tables."""
    tables_id = ensure_profile(tiny_llama).tables_ids[2]
    return tables_id, tables_mod.LOCAL.read_tables(tables_id)


@pytest.fixture(params=["file", "redis", "signed"])
def store(request, tmp_path):
    if request.param == "file":
        s = open_store((tmp_path / "store").as_uri(), secret="")
    elif request.param == "redis":
        s = open_store(request.getfixturevalue("redis_url"), secret="")
    else:
        s = open_store((tmp_path / "store").as_uri(), secret=SECRET)
    yield s
    s.close()


def damage(store, tables_id: str) -> None:
    """Flip one byte of the stored tables record's payload."""
    damage_record(store, "tables", tables_id, at=-100)


def test_tables_round_trip_once_and_apart_from_chunks(store, tiny_tables):
    tables_id, data = tiny_tables
    assert store.get_tables(tables_id) is None
    assert store.put_tables(tables_id, data) is True
    assert store.get_tables(tables_id) == data
    assert store.put_tables(tables_id, data) is False  # written once
    key = chunk_keys(MODEL, "p", list(range(CHUNK)), CHUNK, weights=ServedWeights("f" * 64))[0]
    store.put(key, 2, b"chunk")
    assert [(e.key, e.level) for e in store.list()] == [(key, 2)]  # tables are not chunks
    assert store.stats().entries == 1 and store.stats().payload_bytes == len(b"chunk")
    store.evict(0)
    assert store.get_tables(tables_id) == data  # evicting chunks leaves the tables


def test_tables_round_trip_in_a_redis_cluster(redis_cluster, tiny_tables):
    tables_id, data = tiny_tables
    with open_store(redis_cluster().url(), secret=SECRET) as s:
        assert s.put_tables(tables_id, data) is True
        assert s.put_tables(tables_id, data) is False
        assert s.get_tables(tables_id) == data
        assert list(s.list()) == []


def test_a_damaged_copy_is_refused_and_replaced(store, tiny_tables):
    tables_id, data = tiny_tables
    store.put_tables(tables_id, data)
    damage(store, tables_id)
    with pytest.raises(ChunkCorrupt):
        store.get_tables(tables_id)
    with pytest.raises(TablesRefused, match=f"profile tables {tables_id[:16]} in the store"):
        StoreTables(store).read_tables(tables_id)
    assert store.put_tables(tables_id, data) is True  # the next producer's put repairs it
    assert store.get_tables(tables_id) == data


def test_tables_are_signed_like_records(tmp_path, tiny_tables):
    tables_id, data = tiny_tables
    url = (tmp_path / "store").as_uri()
    with open_store(url, secret="") as unsigned:
        unsigned.put_tables(tables_id, data)
    with open_store(url, secret=SECRET) as signed:
        with pytest.raises(ChunkForged):
            signed.get_tables(tables_id)
        assert signed.put_tables(tables_id, data) is True  # an unsigned copy is not kept
        assert signed.get_tables(tables_id) == data
    with open_store(url, secret="t" * 32) as other:
        with pytest.raises(ChunkForged):
            other.get_tables(tables_id)


def test_bad_ids_and_oversized_tables_are_refused(store, tiny_tables, monkeypatch):
    tables_id, data = tiny_tables
    with pytest.raises(StoreConfigError, match="32 lowercase hex"):
        store.get_tables("../" + tables_id[3:])
    with pytest.raises(StoreConfigError, match="do not hash to their id"):
        store.put_tables(tables_id, data[:-1])
    store.put_tables(tables_id, data)
    monkeypatch.setattr(profile_records, "MAX_TABLES_BYTES", len(data) // 2)
    with pytest.raises(ChunkTooLarge):
        store.put_tables(tables_id, data)
    with pytest.raises(TablesRefused, match="refused"):
        StoreTables(store).read_tables(tables_id)


def test_tables_of_another_model_are_refused(
    tiny_llama, tiny_qwen2, tiny_kv, tmp_path, isolated_profiles
):
    """A bitstream whose header names another model's tables (its CRC made right) decodes
    with neither: the store serves the tables, the codec refuses them for this model."""
    blob = bytearray(codec_for("cachegen", tiny_llama).encode(tiny_kv, 2))
    own = inspect(bytes(blob))["profile_tables"]
    foreign = ensure_profile(tiny_qwen2).tables_ids[2]
    with open_store((tmp_path / "store").as_uri(), secret="") as s:
        publish_tables(s, [own, foreign])
        shutil.rmtree(isolated_profiles)
        tables_mod.forget_cached_tables()
        end = parse_header(bytes(blob)).size
        at = blob.index(bytes.fromhex(own))
        blob[at : at + 16] = bytes.fromhex(foreign)
        blob[end - 4 : end] = struct.pack("<I", zlib.crc32(bytes(blob[: end - 4])))
        provider = StoreTables(s)
        tables_mod.add_provider(provider)
        try:
            with pytest.raises(CodecError, match="do not belong to this bitstream's model"):
                decode(bytes(blob))
        finally:
            tables_mod.remove_provider(provider)


PROBE = """
import hashlib, json, sys
from cachegen.codec import decode
from cachegen.codec.coding.tables import add_provider
from cachegen.store import open_store
from cachegen.store.tables import StoreTables

store = open_store(sys.argv[1])
add_provider(StoreTables(store))
kv = decode(store.get(sys.argv[2], int(sys.argv[3])))
print(json.dumps({
    "tokens": kv.num_tokens,
    "keys": hashlib.sha256(kv.keys.float().numpy().tobytes()).hexdigest(),
    "loaded": sorted(m for m in ("transformers", "cachegen.extract", "cachegen.profiles")
                     if m in sys.modules),
}))
"""


def test_a_consumer_with_an_empty_cache_decodes_from_the_store_alone(tiny_llama, tiny_kv, tmp_path):
    import hashlib

    codec = codec_for("cachegen", tiny_llama, chunk_tokens=CHUNK)
    url = (tmp_path / "store").as_uri()
    ids = tiny_kv.token_ids.tolist()
    weights = tiny_llama.served_weights()
    key = chunk_keys(tiny_kv.model, codec.profile_id, ids, CHUNK, weights=weights)[0]
    chunk = tiny_kv.chunks(CHUNK)[0]
    with open_store(url, secret=SECRET) as s:
        publish_tables(s, [codec.profile.tables_ids[3]])
        s.put(key, 3, codec.encode(chunk, level=3))
    expected = hashlib.sha256(decode(codec.encode(chunk, level=3)).keys.float().numpy().tobytes())
    env = empty_cache_env(tmp_path, SECRET)
    empty = Path(env["CACHEGEN_CACHE_DIR"])
    out = subprocess.run(
        [sys.executable, "-c", PROBE, url, key, "3"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"tokens": CHUNK, "keys": expected.hexdigest(), "loaded": []}
    assert not (empty / "models").exists()  # no model weights were looked for or fetched
    tables_id = codec.profile.tables_ids[3]
    assert (empty / "profiles" / "tables" / f"{tables_id}.cgtab").is_file()  # kept locally


# ---- the connector's transport -----------------------------------------------------------


def _transport(url: str, spec, **options) -> ChunkTransport:
    extra = {"store": url, "chunk_tokens": CHUNK, "save_modes": ["cachegen"]}
    config = ConnectorConfig.from_extra_config({**extra, "cachegen_levels": [2], **options})
    return ChunkTransport(config, spec, spec.identity())


def test_transport_tables_come_from_the_store_and_a_refused_copy_recomputes(
    tiny_llama, tiny_kv, tmp_path, isolated_profiles, monkeypatch
):
    """A producer's save puts the tables into the store first. A consumer that has the profile
    but not its tables, and whose rebuild would differ, loads with the store's tables; once the
    store's copy is damaged and the local one gone, the load stops with the reason and the
    chunks are no hit, but stay stored (they are sound); so they do when no copy is left."""
    import cachegen.profiles as profiles

    url = (tmp_path / "store").as_uri()
    ids = tiny_kv.token_ids.tolist()
    ensure_profile(tiny_llama)  # the producer's `cachegen profile build`: a server builds none
    producer = _transport(url, tiny_llama)
    try:
        assert producer.save(ids, tiny_kv, ["cachegen"]) > 0
        tables_id = producer.codec("cachegen").profile.tables_ids[2]
    finally:
        producer.close()
    with open_store(url) as s:
        assert s.get_tables(tables_id) is not None

    # The consumer machine: the profile file only, and a forward pass that is not
    # bit-identical (its rebuilt tables would differ).
    for path in (isolated_profiles / "tables").iterdir():
        path.unlink()
    tables_mod.forget_cached_tables()
    real = profiles.calibration_kv
    monkeypatch.setattr(profiles, "calibration_kv", lambda spec: _perturbed(real(spec)))
    consumer = _transport(url, tiny_llama)
    try:
        got: list = []
        result = consumer.load(ids, 0, 2, RequestOptions(mode="cachegen"), got.append)
        assert result.error is None and result.chunks_loaded == 2
        assert [kv.start for kv in got] == [0, CHUNK]
        assert (isolated_profiles / "tables" / f"{tables_id}.cgtab").is_file()

        (isolated_profiles / "tables" / f"{tables_id}.cgtab").unlink()
        tables_mod.forget_cached_tables()
        with open_store(url) as s:
            damage(s, tables_id)
        result = consumer.load(ids, 0, 2, RequestOptions(mode="cachegen"), [].append)
        assert result.chunks_loaded == 0
        assert result.error.startswith("TablesRefused: profile tables")
        assert consumer.stored_chunks(ids, RequestOptions(mode="cachegen")) == 0  # no hit

        (tmp_path / "store" / "tables" / f"{tables_id}.cgc").unlink()  # nobody holds them now
        result = consumer.load(ids, 0, 2, RequestOptions(mode="cachegen"), [].append)
        assert result.chunks_loaded == 0
        assert result.error.startswith("TablesMissing: profile tables")
        assert consumer.stored_chunks(ids, RequestOptions(mode="cachegen")) == 0  # no hit
        assert consumer.store.stats().entries == 2  # sound: kept
    finally:
        consumer.close()


def _perturbed(kv):
    return dataclasses.replace(kv, keys=kv.keys * 1.01)


def test_store_put_command_stores_the_tables_first(tiny_llama, tiny_kv, tmp_path, capsys):
    from cachegen.cli import main

    url = (tmp_path / "store").as_uri()
    kv_dir = tiny_kv.save(tmp_path / "kv")
    argv = ["store", "put", str(kv_dir), "--levels", "2", "--store", url, "--json"]
    assert main([*argv, "--chunk-tokens", str(CHUNK)]) == 0
    put = json.loads(capsys.readouterr().out)
    profile = ensure_profile(tiny_llama)
    with open_store(url) as s:
        for tables_id in profile.tables_ids.values():
            assert s.get_tables(tables_id) == tables_mod.LOCAL.read_tables(tables_id)
        assert s.stats().entries == put["chunks"] == 2  # the tables are not counted as chunks


# ---- the profile document and the adopted-profile pointer ------------------------------------


def damage_record(store, kind: str, name: str, at: int = -5) -> None:
    """Flip the byte at ``at`` of a stored tables, profile document or pointer record."""
    if store.url.startswith("file:"):
        path = store.root / kind / f"{name}.cgc"
        data = bytearray(path.read_bytes())
        data[at] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        import redis

        client, key = redis.Redis.from_url(store.url), f"{store.prefix}:{kind}:{name}"
        data = bytearray(client.get(key))
        data[at] ^= 0x01
        client.set(key, bytes(data))
        client.close()


@pytest.fixture(scope="module")
def two_profiles(tiny_llama):
    """tiny-llama's profile, and another one of it (only level 2, its tables shared)."""
    first = ensure_profile(tiny_llama)
    second = transient_profile(tiny_llama, {2: first.config(2)})
    assert first.id != second.id
    return first, second


def never_built():
    raise AssertionError("the local profile was asked for")


def test_first_writer_wins_and_the_second_producer_adopts(store, tiny_llama, two_profiles):
    first, second = two_profiles
    model = tiny_llama.identity()
    choice = resolve_profile(store, model, lambda: first)
    assert (choice.source, choice.adopted, choice.refused) == ("local", True, None)
    assert store.get_profile(first.id) == profile_document(first)
    assert all(store.get_tables(t) is not None for t in first.tables_ids.values())

    theirs = resolve_profile(store, model, never_built)  # the second producer or a consumer
    assert theirs.source == "store" and theirs.profile.id == first.id
    assert profile_document(theirs.profile) == profile_document(first)
    # A producer that read no pointer but writes second loses: the pointer is never replaced.
    assert store.adopt_profile(model.fingerprint, "cachegen", second.id, model.name) is False
    assert store.adopted_profile(model.fingerprint, "cachegen") == first.id
    assert store.pointers() == [(model.fingerprint, "cachegen")]
    assert store.profile_ids() == [first.id]
    assert list(store.list()) == []  # none of it is a chunk


def test_a_damaged_profile_document_is_refused_and_repaired(store, tiny_llama, two_profiles):
    first, second = two_profiles
    model = tiny_llama.identity()
    resolve_profile(store, model, lambda: first)
    damage_record(store, "profiles", first.id)
    with pytest.raises(ChunkCorrupt):
        store.get_profile(first.id)
    choice = resolve_profile(store, model, lambda: second)
    assert choice.source == "local" and choice.profile is second and not choice.adopted
    assert f"the store's adopted profile {first.id}" in choice.refused
    assert store.adopted_profile(model.fingerprint, "cachegen") == first.id  # left alone
    assert store.get_profile(second.id) is not None  # published, for an operator to adopt
    assert store.put_profile(first.id, profile_document(first)) is True  # a damaged copy
    assert resolve_profile(store, model, never_built).profile.id == first.id  # is replaced


def test_a_damaged_pointer_is_refused_until_an_operator_removes_it(store, tiny_llama, two_profiles):
    first, second = two_profiles
    model = tiny_llama.identity()
    resolve_profile(store, model, lambda: first)
    name = f"{model.fingerprint}-cachegen"
    damage_record(store, "adopted", name)
    choice = resolve_profile(store, model, lambda: second)
    assert choice.source == "local" and choice.profile is second
    assert choice.refused.startswith("Chunk")  # ChunkCorrupt, or ChunkForged when signed
    with pytest.raises(ChunkCorrupt):  # not replaced by the second producer
        store.adopted_profile(model.fingerprint, "cachegen")
    assert store.delete_pointer(model.fingerprint, "cachegen") is True
    assert resolve_profile(store, model, lambda: second).adopted is True
    assert resolve_profile(store, model, never_built).profile.id == second.id


def test_a_profile_of_another_model_is_refused(store, tiny_llama, tiny_qwen2, two_profiles):
    first, _ = two_profiles
    qwen = ensure_profile(tiny_qwen2)
    model = tiny_llama.identity()
    publish_profile(store, qwen)
    store.adopt_profile(model.fingerprint, "cachegen", qwen.id, model.name)
    choice = resolve_profile(store, model, lambda: first)
    assert choice.source == "local" and choice.profile is first
    assert f"belongs to model {tiny_qwen2.name}" in choice.refused


def test_profile_documents_are_checked(store, two_profiles):
    first, second = two_profiles
    document = profile_document(first)
    with pytest.raises(StoreConfigError, match="does not hash to its id"):
        store.put_profile(second.id, document)
    with pytest.raises(StoreConfigError, match="16 lowercase hex"):
        store.get_profile("../" + first.id)
    with pytest.raises(StoreConfigError, match="fingerprint"):
        store.adopted_profile("not-hex", "cachegen")
    assert store.put_profile(first.id, document) is True
    assert store.put_profile(first.id, document) is False  # written once
    assert profile_from_document(store.get_profile(first.id), "x").id == first.id
    pretty = json.dumps(json.loads(document), indent=1).encode()
    with pytest.raises(CodecError, match="not in canonical form"):
        profile_from_document(pretty, "x")


def test_profiles_in_a_redis_cluster(redis_cluster, tiny_llama, two_profiles):
    first, second = two_profiles
    model = tiny_llama.identity()
    with open_store(redis_cluster().url(), secret=SECRET) as s:
        assert resolve_profile(s, model, lambda: first).adopted is True
        assert resolve_profile(s, model, lambda: second).profile.id == first.id
        assert s.pointers() == [(model.fingerprint, "cachegen")]
        assert s.profile_ids() == [first.id]


def test_a_consumer_whose_rebuild_differs_adopts_the_stores_profile(
    tiny_llama, tiny_kv, tmp_path, isolated_profiles, monkeypatch
):
    """The consumer's own profile would differ (its forward pass is not bit-identical): with
    ``profile_source: store`` it uses the producer's, so its chunk keys are the producer's and
    the load succeeds; with ``local`` it looks under other keys and finds nothing."""
    import cachegen.profiles as profiles

    url = (tmp_path / "store").as_uri()
    ids = tiny_kv.token_ids.tolist()
    ensure_profile(tiny_llama)  # the producer's `cachegen profile build`: a server builds none
    producer = _transport(url, tiny_llama)
    try:
        assert producer.save(ids, tiny_kv, ["cachegen"]) > 0
        assert producer.profile_choice["adopted"] is True
        produced = producer.codec("cachegen").profile_id
        keys = producer.keys("cachegen", ids)
    finally:
        producer.close()

    # The consumer machine: an empty profile directory and a perturbed forward pass.
    monkeypatch.setenv("CACHEGEN_PROFILE_DIR", str(tmp_path / "consumer-profiles"))
    tables_mod.forget_cached_tables()
    real = profiles.calibration_kv
    monkeypatch.setattr(profiles, "calibration_kv", lambda spec: _perturbed(real(spec)))
    consumer = _transport(url, tiny_llama)
    try:
        assert consumer.profile_choice is None  # made on first use
        assert consumer.keys("cachegen", ids) == keys
        assert consumer.profile_choice == {
            "profile": produced,
            "source": "store",
            "adopted": False,
            "refused": None,
        }
        got: list = []
        result = consumer.load(ids, 0, 2, RequestOptions(mode="cachegen"), got.append)
        assert result.error is None and result.chunks_loaded == 2
        assert consumer.save(ids, tiny_kv, ["cachegen"]) == 0  # nothing new to store
    finally:
        consumer.close()
    ensure_profile(tiny_llama)  # this machine's own build, with its perturbed forward pass
    local = _transport(url, tiny_llama, profile_source="local")
    try:
        assert local.codec("cachegen").profile_id != produced  # the rebuild does differ
        assert local.profile_choice is None
        assert local.stored_chunks(ids, RequestOptions(mode="cachegen")) == 0
    finally:
        local.close()


def test_store_profiles_and_unadopt_commands(tiny_llama, tiny_kv, tmp_path, capsys):
    from cachegen.cli import main

    url = (tmp_path / "store").as_uri()
    kv_dir = tiny_kv.save(tmp_path / "kv")
    put = ["store", "put", str(kv_dir), "--levels", "2", "--store", url, "--json"]
    assert main([*put, "--chunk-tokens", str(CHUNK)]) == 0
    profile_id = json.loads(capsys.readouterr().out)["profile_id"]
    assert main(["store", "profiles", "--store", url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    fingerprint = tiny_llama.identity().fingerprint
    assert (listed["schema"], listed["version"]) == ("cachegen-store-profiles", 1)
    [entry] = listed["profiles"]
    assert entry["id"] == profile_id and entry["adopted"] and entry["error"] is None
    assert entry["model"] == {"name": tiny_llama.name, "fingerprint": fingerprint}
    assert entry["levels"] == sorted(ensure_profile(tiny_llama).levels) and entry["bytes"] > 0
    assert listed["adopted"] == [
        {"fingerprint": fingerprint, "codec": "cachegen", "profile": profile_id, "error": None}
    ]

    assert main(["store", "unadopt", "--store", url, "--fingerprint", "0123"]) != 0
    assert "no adopted cachegen profiles" in capsys.readouterr().err
    assert main(["store", "unadopt", "--store", url, "--fingerprint", fingerprint[:8]]) == 0
    capsys.readouterr()
    assert main(["store", "profiles", "--store", url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["adopted"] == [] and not listed["profiles"][0]["adopted"]


def test_a_transport_with_a_refused_pointer_warns_and_uses_its_own_profile(
    tiny_llama, tiny_kv, tmp_path, caplog
):
    url = (tmp_path / "store").as_uri()
    ids = tiny_kv.token_ids.tolist()
    ensure_profile(tiny_llama)  # the producer's `cachegen profile build`: a server builds none
    producer = _transport(url, tiny_llama)
    try:
        producer.save(ids, tiny_kv, ["cachegen"])
    finally:
        producer.close()
    with open_store(url) as s:
        damage_record(s, "adopted", f"{tiny_llama.identity().fingerprint}-cachegen")
    consumer = _transport(url, tiny_llama)
    try:
        with caplog.at_level("WARNING", logger="cachegen.connector.codecs"):
            assert consumer.stored_chunks(ids, RequestOptions(mode="cachegen")) == 2  # same profile
        assert consumer.profile_choice["source"] == "local"
        assert consumer.profile_choice["refused"].startswith("ChunkCorrupt: ")
        assert "not the store's (ChunkCorrupt: " in caplog.text
    finally:
        consumer.close()
