"""Model files travel with the chunks: a store holds the tcq model file its chunks name (by
id, checked, signed, written once), and a consumer without it decodes from the store alone."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cachegen.codec import ModelFileRefused, decode, get_codec
from cachegen.codec.coding.tables import add_provider, remove_provider
from cachegen.codec.tcq import model as tcq_model
from cachegen.connector.codecs import CodecSet, damaged
from cachegen.connector.config import ConnectorConfig
from cachegen.extract import extract_kv
from cachegen.fitting.tcq import ensure_tcq_model
from cachegen.kv import ModelIdentity
from cachegen.store import ChunkCorrupt, ChunkForged, ChunkTooLarge, open_store, profile_records
from cachegen.store.record import Signer, pack
from cachegen.store.tables import StoreTables, publish_model_file
from tests.codec.transform_support import forget_fitted_files, own_profile_dir
from tests.support import empty_cache_env

CHUNK = 64
SECRET = "s" * 32


@pytest.fixture(scope="module")
def producer_dir(tmp_path_factory):
    """The producer's profile directory, this module's own (tests that play a consumer switch
    to an empty one)."""
    with own_profile_dir(tmp_path_factory.mktemp("producer") / "profiles") as path:
        yield path


@pytest.fixture(scope="module")
def fitted(tiny_llama, producer_dir) -> tcq_model.TcqModel:
    """tiny-llama's tcq model file, fitted into the producer's profile directory."""
    return ensure_tcq_model(tiny_llama)


@pytest.fixture(scope="module")
def tiny_kv(tiny_llama):
    return extract_kv(tiny_llama, token_ids=torch.arange(2 * CHUNK))


@pytest.fixture(params=["file", "redis", "signed"])
def store(request, tmp_path):
    if request.param == "redis":
        s = open_store(request.getfixturevalue("redis_url"), secret=SECRET)
    else:
        secret = SECRET if request.param == "signed" else ""
        s = open_store((tmp_path / "store").as_uri(), secret=secret)
    yield s
    s.close()


@pytest.fixture
def consumer(isolated_profiles):
    """An empty profile directory, no model file in memory: a consumer's machine."""
    forget_fitted_files()
    yield isolated_profiles
    forget_fitted_files()


def digest(kv) -> str:
    return hashlib.sha256(
        kv.keys.float().numpy().tobytes() + kv.values.float().numpy().tobytes()
    ).hexdigest()


# ---- producer and consumer in two processes --------------------------------------------------

PROBE = """
import hashlib, json, sys
from cachegen.codec import add_provider, decode
from cachegen.store import open_store
from cachegen.store.tables import StoreTables

store = open_store(sys.argv[1])
add_provider(StoreTables(store))
out = {}
for info in store.list():
    kv = decode(store.get(info.key, info.level))
    raw = kv.keys.float().numpy().tobytes() + kv.values.float().numpy().tobytes()
    out[f"{info.key} {info.level}"] = hashlib.sha256(raw).hexdigest()
heavy = ("transformers", "cachegen.extract", "cachegen.fitting")
loaded = sorted(m for m in heavy if m in sys.modules)
print(json.dumps({"chunks": out, "loaded": loaded}))
"""


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_a_consumer_with_an_empty_cache_decodes_tcq_chunks_from_a_signed_store(
    backend, fitted, tiny_kv, tmp_path, monkeypatch, capsys, request
):
    """`cachegen store put --codec tcq` stores the model file first; a process with an empty
    cache directory and no model weights decodes every chunk through the public API."""
    from cachegen.cli import main

    url = request.getfixturevalue("redis_url") if backend == "redis" else (tmp_path / "s").as_uri()
    monkeypatch.setenv("CACHEGEN_STORE_SECRET", SECRET)
    kv_dir = tiny_kv.save(tmp_path / "kv")
    level = sorted(fitted.levels)[1]
    argv = ["store", "put", str(kv_dir), "--codec", "tcq", "--levels", str(level), "--json"]
    assert main([*argv, "--store", url, "--chunk-tokens", str(CHUNK)]) == 0
    put = json.loads(capsys.readouterr().out)
    with open_store(url) as s:
        assert s.get_model_file(fitted.id) == fitted.file_bytes
        expected = {f"{i.key} {i.level}": digest(decode(s.get(i.key, i.level))) for i in s.list()}
    assert len(expected) == put["chunks"] == 2
    env = empty_cache_env(tmp_path, SECRET)
    empty = Path(env["CACHEGEN_CACHE_DIR"])
    out = subprocess.run(
        [sys.executable, "-c", PROBE, url], capture_output=True, text=True, env=env, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"chunks": expected, "loaded": []}
    assert not (empty / "models").exists()  # no model weights were looked for or fetched
    kept = empty / "profiles" / "transforms" / f"{fitted.id}.cgtq"
    assert kept.read_bytes() == fitted.file_bytes  # kept locally for the next decode


# ---- what the store refuses ------------------------------------------------------------------


def rewrite(store, file_id: str, change) -> None:
    """Replace the stored model-file record by ``change(record bytes)``."""
    if store.url.startswith("file:"):
        path = store.root / "model-files" / f"{file_id}.cgc"
        path.write_bytes(change(path.read_bytes()))
    else:
        import redis

        client, key = redis.Redis.from_url(store.url), f"{store.prefix}:model-files:{file_id}"
        client.set(key, change(client.get(key)))
        client.close()


def flip(data: bytes) -> bytes:
    return data[:-100] + bytes([data[-100] ^ 1]) + data[-99:]


def test_model_files_round_trip_once_and_apart_from_chunks(store, fitted):
    assert store.get_model_file(fitted.id) is None
    assert publish_model_file(store, fitted) == fitted.nbytes
    assert publish_model_file(store, fitted) == 0  # written once
    assert store.get_model_file(fitted.id) == fitted.file_bytes
    assert list(store.list()) == [] and store.stats().entries == 0


def refusals(fitted, store, monkeypatch):
    """Each way a stored copy can be bad, as (name, how to make it so)."""
    file_id = fitted.id
    forged = Signer(b"t" * 32)

    def resigned(data: bytes) -> bytes:  # altered, its checksum recomputed, MAC not
        return pack(f"model-files:{file_id}", 0, flip(data)[-fitted.nbytes :], forged)

    return {
        "truncated": lambda: rewrite(store, file_id, lambda d: d[:-1000]),
        "altered": lambda: rewrite(store, file_id, flip),
        "resigned": lambda: rewrite(store, file_id, resigned),
        "too large": lambda: monkeypatch.setattr(
            profile_records, "MAX_MODEL_FILE_BYTES", fitted.nbytes // 2
        ),
    }


@pytest.mark.parametrize("bad", ["truncated", "altered", "resigned", "too large"])
def test_a_bad_stored_copy_is_refused_before_use(
    bad, store, fitted, tiny_kv, consumer, monkeypatch
):
    blob = get_codec("tcq", tcq=fitted, chunk_tokens=CHUNK).encode(
        tiny_kv.chunks(CHUNK)[0], sorted(fitted.levels)[0]
    )
    store.put_model_file(fitted.id, fitted.file_bytes)
    refusals(fitted, store, monkeypatch)[bad]()
    expected = {"truncated": ChunkCorrupt, "too large": ChunkTooLarge}.get(bad, ChunkCorrupt)
    if bad == "resigned" and store.signed:
        expected = ChunkForged
    with pytest.raises(expected):
        store.get_model_file(fitted.id)
    provider = StoreTables(store)
    add_provider(provider)
    try:
        with pytest.raises(ModelFileRefused, match=f"model file {fitted.id[:16]} in the store"):
            decode(blob)
    finally:
        remove_provider(provider)
    assert not tcq_model.tcq_model_path(fitted.id).exists()  # nothing kept


def test_another_models_file_is_refused(store, fitted, tiny_llama, consumer):
    """A bitstream's model file must be fitted for the bitstream's model: a stored file of
    another model (the same geometry) is refused, and not kept."""
    theirs = ModelIdentity(
        "other",
        "e" * 64,
        *(getattr(fitted.model, f) for f in ("num_layers", "num_kv_heads", "head_dim")),
    )
    other = dataclasses.replace(fitted, model=theirs)
    publish_model_file(store, other)
    provider = StoreTables(store)
    add_provider(provider)
    try:
        with pytest.raises(ModelFileRefused, match="fitted for model other"):
            tcq_model.find_tcq_model(other.id, tiny_llama.identity())
    finally:
        remove_provider(provider)
    assert not tcq_model.tcq_model_path(other.id).exists()


def test_bad_ids_and_changed_files_are_not_stored(store, fitted):
    from cachegen.store import StoreConfigError

    with pytest.raises(StoreConfigError, match="32 lowercase hex"):
        store.get_model_file("../" + fitted.id[3:])
    with pytest.raises(StoreConfigError, match="do not hash to their id"):
        store.put_model_file(fitted.id, fitted.file_bytes[:-1])


# ---- the connector -----------------------------------------------------------------------


def test_the_connectors_consumer_finds_the_producers_model_file_in_the_store(
    fitted, producer_dir, tiny_llama, tiny_kv, tmp_path, consumer
):
    """The producer's CodecSet publishes tcq's model file with its first record; a consumer's
    CodecSet makes the store a provider, so a load decodes with it; a damaged copy stops the
    load with the reason, the chunk counted sound (it is recomputed, not deleted)."""
    url = (tmp_path / "store").as_uri()
    config = ConnectorConfig.from_extra_config({"store": url, "chunk_tokens": CHUNK})
    with open_store(url) as s:
        with own_profile_dir(producer_dir):
            producer = CodecSet(s, config, tiny_llama, tiny_llama.identity())
            producer.publish_tables("tcq")
            blob = producer.get("tcq").encode(tiny_kv.chunks(CHUNK)[0], sorted(fitted.levels)[0])
            producer.close()
        assert s.get_model_file(fitted.id) == fitted.file_bytes

        user = CodecSet(s, config, tiny_llama, tiny_llama.identity())
        try:
            user.get("raw")  # any codec: the store is a provider from then on
            assert decode(blob).num_tokens == CHUNK
            assert tcq_model.tcq_model_path(fitted.id).read_bytes() == fitted.file_bytes

            tcq_model.tcq_model_path(fitted.id).unlink()
            forget_fitted_files()
            rewrite(s, fitted.id, flip)
            with pytest.raises(ModelFileRefused) as refused:
                decode(blob)
            assert not damaged(refused.value)
        finally:
            user.close()
