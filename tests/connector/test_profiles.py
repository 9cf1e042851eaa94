"""Profiles and their tables in the store, through a real vLLM CPU engine (tiny-llama,
directory store): the engine uses the profile the store adopted, not its own; chunks whose
tables are damaged are no hit (the log says why), and the answer is the one computed from
text."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachegen.codec.coding import tables as tables_mod
from cachegen.connector.config import RequestOptions
from cachegen.store import open_store
from cachegen.store.tables import publish_tables
from tests.support import connector_engine


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("connector-profiles-store")


@pytest.fixture(scope="module")
def seeded_profile(tiny_llama, store_dir):
    """A profile of tiny-llama other than the one this machine has (level 2 only), adopted by
    the store before the engine starts."""
    from cachegen.profiles import ensure_profile, transient_profile
    from cachegen.store.tables import resolve_profile

    local = ensure_profile(tiny_llama)
    seeded = transient_profile(tiny_llama, {2: local.config(2)})
    assert seeded.id != local.id
    with open_store(store_dir.as_uri()) as store:
        assert resolve_profile(store, tiny_llama.identity(), lambda: seeded).adopted
    return seeded


@pytest.fixture(scope="module")
def engine(tiny_llama, store_dir, seeded_profile):
    with connector_engine(
        tiny_llama, store_dir.as_uri(), save_modes=("cachegen",), cachegen_levels=[2]
    ) as eng:
        yield eng


def test_damaged_tables_in_the_store_recompute_with_the_reason(
    engine, store_dir, text_ids, tmp_path, monkeypatch, caplog
):
    ids = text_ids(engine, 600, offset=30_000)
    engine.store_prefix(ids)
    text = engine.run(ids)
    tables_id = engine.transport.codec("cachegen").profile.tables_ids[2]
    with open_store(store_dir.as_uri()) as store:
        assert store.get_tables(tables_id) is not None  # the save put them there first
    hit = engine.run(ids, mode="cachegen", level=2)
    assert hit.connector["loaded_tokens"] == 512 and "load_error" not in hit.connector

    path = store_dir / "tables" / f"{tables_id}.cgc"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    # The engine now has no tables of its own: an empty tables directory, none in memory, and
    # no tables from the stores of other engines still alive in this test session.
    monkeypatch.setenv("CACHEGEN_PROFILE_DIR", str(tmp_path / "profiles"))
    label = engine.transport.store.label
    own = [p for p in tables_mod._providers if getattr(p, "store", None) is not None]
    own = [p for p in own if p.store.label == label]  # the connector's and the test's view
    assert own
    monkeypatch.setattr(tables_mod, "_providers", [tables_mod.LOCAL, *own])
    tables_mod.forget_cached_tables()
    try:
        with caplog.at_level("WARNING", logger="cachegen.connector.codecs"):
            refused = engine.run(ids, mode="cachegen", level=2)
        assert "are not counted as hits: profile tables" in caplog.text and "refused" in caplog.text
        assert "load_error" not in refused.connector  # no load was tried: a miss
        assert refused.connector.get("loaded_tokens", 0) == 0
        assert refused.token_ids == text.token_ids
        options = RequestOptions(mode="cachegen", level=2)
        assert engine.transport.stored_chunks(ids, options) == 0  # no hit: not decodable here
        assert open_store(store_dir.as_uri()).stats().entries > 0  # sound chunks are kept
    finally:
        monkeypatch.undo()
        tables_mod.forget_cached_tables()
    with open_store(store_dir.as_uri()) as store:
        assert publish_tables(store, [tables_id]) > 0  # a producer with the tables repairs it
    again = engine.run(ids, mode="cachegen", level=2)
    assert again.connector["loaded_tokens"] == 512 and again.token_ids == text.token_ids


def test_the_engine_uses_the_profile_the_store_adopted(engine, seeded_profile, text_ids):
    ids = text_ids(engine, 300, offset=40_000)
    engine.store_prefix(ids)  # saved by the connector's worker, found by the harness' transport
    assert engine.transport.profile_choice["source"] == "store"
    assert engine.transport.codec("cachegen").profile_id == seeded_profile.id
    hit = engine.run(ids, mode="cachegen", level=2)
    assert hit.connector["loaded_tokens"] == 256 and "load_error" not in hit.connector
