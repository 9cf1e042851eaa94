"""Chunk keys name the weights vLLM actually runs (``cachegen.models.ServedWeights``): the hub
revision it loaded, its ``hf_overrides``, its ``quantization`` and every byte of the weights
(tests/core/test_weights_digest.py), in a chain seeded with the namespace's full SHA-256.

The engine test starts two tiny-llama engines on one store: one with other ``hf_overrides``
(another RoPE base) and one serving the plain model, which loads what ``cachegen store put``
stored for that model.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cachegen import models
from cachegen.errors import ModelError
from cachegen.models import ServedWeights
from cachegen.store import StoreConfigError, open_store, profile_records
from cachegen.store.keys import (
    chunk_keys,
    namespace,
    namespace_digest,
    sliding_key,
    validate_key,
)
from tests.support import CHUNK, connector_engine

REPO = "acme/tiny-llama"
ROPE = {"rope_parameters": {"rope_theta": 40000.0, "rope_type": "default"}}


def hub_cache(root: Path, revisions: dict[str, Path], repo: str = REPO) -> dict[str, Path]:
    """A Hugging Face hub cache under ``root`` built by hand, laid out as huggingface_hub lays
    one out: ``refs/<revision>`` holds each revision's commit, ``snapshots/<commit>/`` links
    each file of the model directory ``revisions[revision]`` (config.json and its weight files)
    to ``blobs/<name>``, the SHA-256 of a weight file's content (an LFS file) or the git SHA-1
    of a small file's. The snapshot of each revision."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs").mkdir(exist_ok=True)
    snapshots = {}
    for revision, source in revisions.items():
        commit = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
        (repo_dir / "refs" / revision).write_text(commit)
        snapshot = repo_dir / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in [source / "config.json", *models.weight_files(source)]:
            data = file.read_bytes()
            if file.suffix == ".safetensors":
                blob = hashlib.sha256(data).hexdigest()
            else:
                blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            if not (repo_dir / "blobs" / blob).exists():
                (repo_dir / "blobs" / blob).write_bytes(data)
            (snapshot / file.name).symlink_to(Path("../../blobs") / blob)
        snapshots[revision] = snapshot
    return snapshots


def _keys(spec: models.ModelSpec, weights: ServedWeights, salt: str | None = None) -> list[str]:
    return chunk_keys(spec.identity(), "p", list(range(3, 3 + 2 * CHUNK)), CHUNK,
                      weights=weights, salt=salt)  # fmt: skip


def _model_config(spec: models.ModelSpec, **fields) -> SimpleNamespace:
    """What the connector reads of vLLM's ``model_config``, for an engine serving ``spec``."""
    base = {"model": str(spec.path), "revision": None, "hf_overrides": {}, "quantization": None}
    return SimpleNamespace(**{**base, **fields})


# ---- the revision vLLM loaded ------------------------------------------------------------------


def test_two_revisions_resolve_to_their_own_snapshots_and_keys(tiny_llama, tmp_path, monkeypatch):
    from cachegen.connector.connector import served_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    # v2 has the same files as main: only the revision tells their keys apart
    snapshots = hub_cache(cache, {"main": tiny_llama.path, "v2": tiny_llama.path})
    main = models.resolve(REPO, cache_dir=cache)
    v2 = models.resolve(REPO, revision="v2", cache_dir=cache)
    assert (main.source, main.path, v2.path) == ("hub", snapshots["main"], snapshots["v2"])
    assert (main.commit, v2.commit) == (snapshots["main"].name, snapshots["v2"].name)
    assert models.resolve(REPO, revision=v2.commit, cache_dir=cache).path == v2.path
    # An engine started with --revision v2 and --download-dir: both reach the resolver.
    engine = served_model(_model_config(main, model=REPO, revision="v2"), str(cache))
    assert engine.path == v2.path and engine.served_weights().revision == v2.commit
    assert served_model(_model_config(main, model=REPO), str(cache)).path == main.path

    assert main.identity() == v2.identity()
    assert main.served_weights().digest == v2.served_weights().digest
    assert not set(_keys(main, main.served_weights())) & set(_keys(v2, v2.served_weights()))
    with pytest.raises(ModelError, match="acme/tiny-llama at revision 'v3'"):
        models.resolve(REPO, revision="v3", cache_dir=cache)


def test_a_hub_blob_is_named_by_its_sha256_and_not_read(tiny_llama, tmp_path, monkeypatch):
    """A snapshot's weight file links to ``blobs/<sha256 of its content>``: that name is its
    digest (the hash the checkpoint carries), so a snapshot digests as a plain copy of it does
    without reading its weights. config.json's blob is named by a git SHA-1: it is read."""
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache-root"))
    snapshot = hub_cache(tmp_path / "hub", {"main": tiny_llama.path})["main"]
    real, read = models._sha256_file, []
    monkeypatch.setattr(models, "_sha256_file", lambda path: read.append(path) or real(path))
    assert (snapshot / "model.safetensors").is_symlink()
    assert models.weights_digest(snapshot) == models.weights_digest(tiny_llama.path)
    assert [p.parent.name for p in read] == ["blobs", "tiny-llama", "tiny-llama"]
    assert read[0] == (snapshot / "config.json").resolve()


# ---- hf_overrides and quantization ---------------------------------------------------------


def test_a_plain_engine_keys_as_cachegen_store_put(tiny_llama):
    """An engine serving the model's directory as it is has the CLI's served weights."""
    assert ServedWeights.of_engine(tiny_llama, _model_config(tiny_llama)) == (
        tiny_llama.served_weights()
    )
    assert tiny_llama.served_weights() == ServedWeights(models.weights_digest(tiny_llama.path))


def test_hf_overrides_are_in_the_key(tiny_llama):
    from transformers import AutoConfig

    def weights(**fields) -> ServedWeights:
        return ServedWeights.of_engine(tiny_llama, _model_config(tiny_llama, **fields))

    plain = weights()
    rope = weights(hf_overrides={**ROPE, "max_position_embeddings": 4096})
    same = weights(hf_overrides={"max_position_embeddings": 4096, **ROPE})  # another order
    other = weights(hf_overrides={"rope_parameters": {"rope_theta": 20000.0}})
    assert rope == same and rope.hf_overrides == json.dumps(
        {**ROPE, "max_position_embeddings": 4096}, sort_keys=True, separators=(",", ":")
    )
    keys = [_keys(tiny_llama, w) for w in (plain, rope, other)]
    assert len({k for ks in keys for k in ks}) == 3 * 2

    # A function is keyed by the config it made: two engines agree iff their configs agree.
    config = AutoConfig.from_pretrained(tiny_llama.path)
    longer = AutoConfig.from_pretrained(tiny_llama.path)
    longer.rope_parameters = {"rope_theta": 40000.0, "rope_type": "default"}

    def fn(hf_config):
        return hf_config

    made = weights(hf_overrides=fn, hf_config=config)
    assert made == weights(hf_overrides=lambda c: c, hf_config=config)  # another function
    digest = hashlib.sha256(config.to_json_string().encode()).hexdigest()
    assert made.hf_overrides == f"config-sha256:{digest}"
    yarn = weights(hf_overrides=fn, hf_config=longer)
    assert yarn != made and not set(_keys(tiny_llama, yarn)) & set(_keys(tiny_llama, made))


def test_quantization_is_in_the_key(tiny_llama):
    plain = ServedWeights.of_engine(tiny_llama, _model_config(tiny_llama))
    fp8 = ServedWeights.of_engine(tiny_llama, _model_config(tiny_llama, quantization="fp8"))
    assert (plain.quantization, fp8.quantization) == (None, "fp8")
    assert not set(_keys(tiny_llama, plain)) & set(_keys(tiny_llama, fp8))
    salted = [_keys(tiny_llama, w, salt="tenant-a") for w in (plain, fp8)]
    assert not set(salted[0]) & set(salted[1])


# ---- the chain's seed and the key's form ---------------------------------------------------


def test_the_chain_is_seeded_with_the_full_sha256_of_the_namespace(tiny_llama):
    identity, weights = tiny_llama.identity(), tiny_llama.served_weights()
    ids = list(range(3, 3 + CHUNK))
    full = namespace_digest(identity, "p", CHUNK, weights=weights)
    assert len(full) == 64 and namespace(identity, "p", CHUNK, weights=weights) == full[:16]
    tokens = np.asarray(ids, dtype="<i8").tobytes()

    def first_digest(seed: bytes) -> str:
        return hashlib.sha256(hashlib.sha256(seed).digest() + tokens).hexdigest()[:40]

    [key] = chunk_keys(identity, "p", ids, CHUNK, weights=weights)
    assert key == f"{full[:16]}/{first_digest(full.encode())}"
    [salted] = chunk_keys(identity, "p", ids, CHUNK, weights=weights, salt="s")
    salted_seed = full.encode() + b"\0salt\0" + b"s"
    assert salted == f"{full[:16]}/{first_digest(salted_seed)}"
    assert key != f"{full[:16]}/{first_digest(full[:16].encode())}"  # not the 64-bit seed


def test_a_key_or_record_id_with_a_trailing_newline_is_refused(tiny_llama, tmp_path):
    """``$`` matches before a final newline; every anchored pattern of the store ends at
    ``\\Z``."""
    from cachegen_lab.network.netns import NAME_RE

    key = _keys(tiny_llama, tiny_llama.served_weights())[0]
    assert validate_key(key) == key
    for bad in (key + "\n", key + "-sliding\n"):
        with pytest.raises(StoreConfigError, match="invalid chunk key"):
            validate_key(bad)
    with pytest.raises(StoreConfigError, match="invalid chunk key"):
        sliding_key(key + "\n")
    patterns = {
        profile_records.FILE_ID_RE: "0" * 32,
        profile_records.PROFILE_ID_RE: "0" * 16,
        profile_records.FINGERPRINT_RE: "0" * 64,
        profile_records.CODEC_NAME_RE: "tcq",
        NAME_RE: "cachegen-12-0123abcd",
    }
    for pattern, good in patterns.items():
        assert pattern.match(good) and not pattern.match(good + "\n"), pattern.pattern
    with open_store((tmp_path / "store").as_uri()) as store:
        with pytest.raises(StoreConfigError, match="32 lowercase hex"):
            store.get_tables("0" * 32 + "\n")
        with pytest.raises(StoreConfigError, match="invalid chunk key"):
            store.put(key + "\n", 0, b"x")


# ---- through vLLM: hf_overrides and `cachegen store put` -----------------------------------


def _wait_saved(engine, ids: list[int], weights: ServedWeights, timeout_s: float = 120) -> None:
    """Until every whole chunk of ``ids`` is stored under the keys of ``weights``."""
    from cachegen.connector.transport import EngineStore

    store = EngineStore.open(engine.config, engine.spec, engine.spec.identity(), weights)
    try:
        deadline = time.monotonic() + timeout_s
        while store.index().saved_chunks(ids, engine.config.save_modes) < len(ids) // CHUNK:
            assert time.monotonic() < deadline, f"not stored within {timeout_s} s"
            time.sleep(0.05)
    finally:
        store.close()


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory, text_ids):
    """Prompt A's chunks put by `cachegen store put`, prompt B's saved by an engine with other
    ``hf_overrides`` (another RoPE base); which of them each engine loads."""
    from cachegen.cli import main
    from cachegen.extract import extract_kv

    root = tmp_path_factory.mktemp("model-keys")
    url = (root / "store").as_uri()
    runs = {}
    with connector_engine(tiny_llama, url, hf_overrides=ROPE) as rope:
        model_config = rope.llm.llm_engine.model_config
        runs["rope_theta"] = model_config.hf_config.rope_parameters["rope_theta"]
        weights = ServedWeights.of_engine(tiny_llama, model_config)
        runs["weights"] = weights
        a, b = text_ids(rope, 2 * CHUNK + 16), text_ids(rope, 2 * CHUNK + 16, offset=20_000)
        kv = extract_kv(tiny_llama, token_ids=torch.tensor(a[: 2 * CHUNK]))
        put = ["store", "put", str(kv.save(root / "kv")), "--codec", "raw", "--store", url]
        assert main([*put, "--chunk-tokens", str(CHUNK)]) == 0
        runs["rope: put's chunks"] = rope.run(a, mode="raw")
        rope.run(b, mode="raw", save=True)
        _wait_saved(rope, b, weights)
        runs["rope: its own chunks"] = rope.run(b, mode="raw")
    with connector_engine(tiny_llama, url) as plain:
        runs["plain: put's chunks"] = plain.run(a, mode="raw")
        runs["plain: rope's chunks"] = plain.run(b, mode="raw")
    return runs


def test_the_engine_keys_its_hf_overrides(runs, tiny_llama):
    assert runs["rope_theta"] == 40000.0  # the override reached the model
    assert runs["weights"].hf_overrides == json.dumps(ROPE, sort_keys=True, separators=(",", ":"))
    assert runs["weights"].digest == tiny_llama.served_weights().digest


def test_other_hf_overrides_load_nothing_and_the_same_load_everything(runs):
    assert runs["rope: put's chunks"].connector.get("loaded_tokens", 0) == 0
    assert runs["rope: put's chunks"].cached_tokens == 0
    assert runs["rope: its own chunks"].connector["loaded_tokens"] == 2 * CHUNK
    assert runs["plain: rope's chunks"].connector.get("loaded_tokens", 0) == 0


def test_a_plain_engine_loads_what_cachegen_store_put_stored(runs):
    assert runs["plain: put's chunks"].connector["loaded_tokens"] == 2 * CHUNK
    assert runs["plain: put's chunks"].cached_tokens == 2 * CHUNK
