"""Records named by address (cachegen.store.RecordAddress): one name for a record's chunk, part
and form, its slot beside the key private to the backends, and stores written before it."""

from __future__ import annotations

import pytest

from cachegen.kv import ModelIdentity
from cachegen.models import ServedWeights
from cachegen.modes import CACHEGEN, PACKED, TCQ, Form
from cachegen.store import (
    FULL,
    SLIDING,
    ChunkMissing,
    RecordAddress,
    StoreConfigError,
    chunk_keys,
    stored_prefix,
)
from cachegen.store.keys import sliding_key

MODEL = ModelIdentity("m", "f" * 64, num_layers=2, num_kv_heads=1, head_dim=64)
WEIGHTS = ServedWeights("f" * 64)
KEYS = chunk_keys(MODEL, "p", list(range(256 * 4)), 256, weights=WEIGHTS)


def test_an_address_names_a_records_chunk_part_and_form():
    address = RecordAddress.of(KEYS[0], "cachegen-11-packed", SLIDING)
    scope, digest = KEYS[0].split("/")
    assert (address.scope, address.digest, address.part) == (scope, digest, SLIDING)
    assert address.form == Form(CACHEGEN, 11, PACKED)
    assert address.chunk_key == KEYS[0] and address.key == sliding_key(KEYS[0])
    assert RecordAddress.of(KEYS[0], Form(TCQ, 22), FULL).key == KEYS[0]
    assert address.with_part(None).with_form(Form("int8")) == RecordAddress.of(KEYS[0], "int8")
    with pytest.raises(StoreConfigError, match="unknown part"):
        RecordAddress.of(KEYS[0], "int8", "middle")
    with pytest.raises(StoreConfigError, match="invalid chunk key"):
        RecordAddress.of("../x", "int8")


def test_every_form_of_a_chunk_is_its_own_record(store):
    """A scope's keys belong to one codec profile (the namespace hashes it), so the forms
    under one key are one codec's levels; another codec's forms live under its own keys."""
    int8_key = chunk_keys(MODEL, "int8-profile", list(range(256)), 256, weights=WEIGHTS)[0]
    forms = [Form(CACHEGEN, 11), Form(CACHEGEN, 11, PACKED), Form(CACHEGEN, 4)]
    records = [RecordAddress.of(KEYS[0], form) for form in forms]
    records.append(RecordAddress.of(int8_key, "int8"))
    for i, address in enumerate(records):
        store.write(address, bytes([i]) * (i + 1))
    assert [store.read(a) for a in records] == [bytes([i]) * (i + 1) for i in range(4)]
    assert store.payload_sizes([*records, records[0].with_part(SLIDING)]) == [1, 2, 3, 4, None]
    assert store.holds([records[1], RecordAddress.of(KEYS[1], forms[1])]) == [True, False]
    assert store.remove(records[1]) == 1
    with pytest.raises(ChunkMissing):
        store.read(records[1])
    assert [type(x) for x in store.read_many(records[:3])] == [bytes, ChunkMissing, bytes]


def test_a_store_written_before_addresses_loads(store):
    """Releases before the address wrote a packed form at its level with bit 15 set beside the
    key, and a baseline at 0: the same records an address reads."""
    store.put(KEYS[0], 11 | 1 << 15, b"packed")
    store.put(sliding_key(KEYS[0]), 11, b"sliding coded")
    store.put(KEYS[0], 0, b"int8")
    assert store.read(RecordAddress.of(KEYS[0], "cachegen-11-packed")) == b"packed"
    assert store.read(RecordAddress.of(KEYS[0], "cachegen-11", SLIDING)) == b"sliding coded"
    assert store.read(RecordAddress.of(KEYS[0], "int8")) == b"int8"


def test_stored_prefix_needs_every_record_of_each_chunk(store):
    needed = [[RecordAddress.of(k, "cachegen-4"), RecordAddress.of(k, "int8")] for k in KEYS]
    for first, second in needed[:3]:
        store.write(first, b"x")
    for _, second in needed[:2] + needed[3:]:
        store.write(second, b"y")
    assert stored_prefix(store, needed) == 2  # chunk 2 lacks its int8 record
    assert stored_prefix(store, [[first] for first, _ in needed]) == 3
    assert stored_prefix(store, []) == 0
