"""Tenants sharing a store: vLLM's cache_salt and the operator's tenant scope every chunk key, so
different salts never share a chunk and the same salt does; the caps on what a load reads.

The engine test is the one from docs/security.md: SmolLM2 in vLLM's CPU build with the connector
in int8 mode, the same 512-token context sent as tenant-a, tenant-b, tenant-a again and without
a salt (run with ``pytest -rP`` to see the TTFTs it prints).
"""

from __future__ import annotations

import pytest
import torch

from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.connector.transport import ChunkTransport
from cachegen.modes import RECOMPUTE
from cachegen.store.keys import chunk_keys, key_scope
from tests.support import CHUNK, connector_engine, private_file

CONTEXT = 512  # two chunks: enough to tell a salt's chunks from another's
QUESTION = "\n\nQuestion: what is this text about? Answer:"


def test_salts_and_tenants_give_disjoint_keys(tiny_llama):
    identity, weights = tiny_llama.identity(), tiny_llama.served_weights()
    ids = list(range(4 * CHUNK))

    def keys(salt):
        return chunk_keys(identity, "p", ids, CHUNK, weights=weights, salt=salt)

    scopes = [
        None,
        key_scope(None, "tenant-a"),
        key_scope(None, "tenant-b"),
        key_scope("acme", None),
        key_scope("acme", "tenant-a"),
        key_scope("tenant-a", None),  # a tenant named like a salt is still another scope
    ]
    assert key_scope(None, None) is None
    all_keys = [k for scope in scopes for k in keys(scope)]
    assert len(set(all_keys)) == len(all_keys) == 4 * len(scopes)
    assert keys(key_scope(None, "tenant-a")) == keys(key_scope(None, "tenant-a"))
    # Unsalted keys are the keys without a scope (those of a tenant-less engine).
    assert keys(None) == chunk_keys(identity, "p", ids, CHUNK, weights=weights)
    # Every key keeps the namespace, so `cachegen store ls --prefix NS` still lists a model's.
    assert {k.split("/")[0] for k in all_keys} == {keys(None)[0].split("/")[0]}


@pytest.mark.parametrize("bad", ["", "a/b", "x@y", "back\\slash", "nul\0", "x" * 129, "tab\t", 7])
def test_a_malformed_salt_or_tenant_is_refused_with_the_rule(bad):
    from cachegen.store import StoreConfigError

    with pytest.raises(StoreConfigError, match="at most 128 printable characters"):
        key_scope(None, bad)
    with pytest.raises(ConnectorError, match="tenant .* is not valid"):
        ConnectorConfig.from_extra_config({"tenant": bad})


def test_a_client_cannot_choose_its_key_scope(tmp_path):
    with pytest.raises(ConnectorError, match="unknown kv_transfer_params"):
        RequestOptions().override({"salt": '[null, "tenant-b"]'})
    secret_file = private_file(tmp_path / "secret", "s3cr3t-value-of-16+")
    config = ConnectorConfig.from_extra_config(
        {"tenant": "acme", "store_secret_file": str(secret_file), "max_load_bytes": "1mb"}
    )
    assert config.max_load_bytes == 1_000_000 and "s3cr3t-value" not in repr(config)
    with pytest.raises(ConnectorError, match="max_record_bytes"):
        ConnectorConfig.from_extra_config({"max_record_bytes": -1})


def test_max_load_bytes_refuses_a_load_before_it_starts(tiny_llama, tmp_path):
    from cachegen.extract import extract_kv

    kv = extract_kv(tiny_llama, token_ids=torch.arange(3, 3 + 2 * CHUNK))
    ids = kv.token_ids.tolist()

    def transport(**extra):
        config = ConnectorConfig.from_extra_config(
            {"store": (tmp_path / "store").as_uri(), "chunk_tokens": CHUNK, **extra}
        )
        return ChunkTransport(config, tiny_llama, tiny_llama.identity())

    writer = transport()
    try:
        writer.save(ids, kv, ["raw"])
    finally:
        writer.close()
    raw = RequestOptions(mode="raw")
    capped = transport(max_load_bytes=kv.nbytes // 2)
    try:
        got = []
        result = capped.load(ids, 0, 2, raw, got.append)
        assert result.chunks_loaded == 0 and not got
        assert "max_load_bytes" in result.error and "recomputing" in result.error
    finally:
        capped.close()
    roomy = transport(max_load_bytes=2 * kv.nbytes)
    try:
        result = roomy.load(ids, 0, 2, raw, lambda chunk: None)
        assert result.error is None and result.chunks_loaded == 2
    finally:
        roomy.close()


SECRET = "test-secret-not-for-production"


@pytest.fixture(scope="module")
def engine(smollm2, tmp_path_factory):
    """A connector engine whose store is signed with ``SECRET`` (read from a file)."""
    store = tmp_path_factory.mktemp("tenant-store").as_uri()
    secret_file = private_file(tmp_path_factory.mktemp("tenant-secret") / "secret", SECRET)
    with connector_engine(
        smollm2,
        store,
        save_modes=("int8",),
        connector_extra={"store_secret_file": str(secret_file)},
    ) as eng:
        yield eng


def test_cache_salt_isolates_tenants_through_vllm(engine, text_ids):
    prompt = text_ids(engine, CONTEXT) + engine.tokenize(QUESTION, bos=False)
    engine.run(prompt, max_tokens=2)  # warm-up: the first forward pass is slower

    def ask(salt, *, save=False):
        return engine.run(prompt, mode="int8", save=save, cache_salt=salt, max_tokens=4)

    first_a = ask("tenant-a", save=True)
    assert first_a.connector.get("loaded_tokens", 0) == 0
    assert first_a.connector["save_chunks"] == CONTEXT // CHUNK
    assert first_a.connector["salted"] is True
    engine.wait_stored(prompt, cache_salt="tenant-a")

    other = ask("tenant-b")
    again_a = ask("tenant-a")
    unsalted = ask(None)
    recompute = engine.run(prompt, mode=RECOMPUTE, max_tokens=4)
    assert other.connector.get("loaded_tokens", 0) == 0 and other.cached_tokens == 0
    assert unsalted.connector.get("loaded_tokens", 0) == 0 and "salted" not in unsalted.connector
    assert again_a.connector["loaded_tokens"] == CONTEXT == again_a.cached_tokens
    print(
        "TTFT (s): tenant-a first",
        round(first_a.ttft_s, 3),
        "| tenant-b",
        round(other.ttft_s, 3),
        "| tenant-a again",
        round(again_a.ttft_s, 3),
        "| no salt",
        round(unsalted.ttft_s, 3),
        "| recompute",
        round(recompute.ttft_s, 3),
    )


def test_a_forged_chunk_is_refused_and_recomputed(engine, text_ids):
    """A writer without the secret replaces the first stored chunk with well-formed bytes (a
    record with a correct checksum): the signed engine refuses it and answers like recompute."""
    from cachegen.store import RecordAddress, open_store

    prompt = text_ids(engine, CONTEXT, offset=50_000) + engine.tokenize(QUESTION, bos=False)
    engine.store_prefix(prompt)
    key = engine.transport.keys("int8", prompt)[0]
    (form,) = engine.transport.forms("int8")
    record = RecordAddress.of(key, form)
    assert engine.run(prompt, mode="int8", max_tokens=4).connector["loaded_tokens"] == CONTEXT

    intruder = open_store(engine.config.store, secret="")  # no secret: writes unsigned records
    try:
        blob = bytearray(intruder.read(record))  # reading without the secret is possible
        blob[-64:] = bytes(64)  # change the KV's last bytes
        intruder.write(record, bytes(blob))
    finally:
        intruder.close()
    forged = engine.run(prompt, mode="int8", max_tokens=8)
    recomputed = engine.run(prompt, mode=RECOMPUTE, max_tokens=8)
    assert forged.connector.get("loaded_tokens", 0) == 0
    assert "secret" in forged.connector["load_error"]
    assert forged.token_ids == recomputed.token_ids
    assert SECRET not in str(forged.connector)
