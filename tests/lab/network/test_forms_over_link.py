"""The fastest-form controller loading real KV stored coded, packed and as int8, over a real
socket."""

from __future__ import annotations

import pytest
import torch

from cachegen.codec import decode
from cachegen.modes import CACHEGEN, PACKED, Form
from cachegen.store import RecordAddress, chunk_keys, open_store
from cachegen.stream import FastestController, Option, stream_load
from cachegen_lab.network import open_link

# ---- real KV, three forms, a real socket ---------------------------------------------------

CHUNK = 32
CHUNKS = 4


@pytest.fixture(scope="module")
def forms_store(tmp_path_factory, tiny_llama):
    """A directory store with ``CHUNKS`` chunks of tiny-llama's KV, each coded and packed at the
    default level and as int8 (under int8's keys), except chunk 2, which has no packed record."""
    from cachegen.extract import extract_kv
    from cachegen.profiles import codec_for

    ids = torch.arange(10, 10 + CHUNK * CHUNKS)
    kv = extract_kv(tiny_llama, token_ids=ids)
    cachegen = codec_for("cachegen", tiny_llama, chunk_tokens=CHUNK)
    int8 = codec_for("int8", tiny_llama, chunk_tokens=CHUNK)
    level = cachegen.default_level
    store = open_store((tmp_path_factory.mktemp("forms") / "store").as_uri())
    weights = tiny_llama.served_weights()
    keys = {
        name: chunk_keys(tiny_llama.identity(), codec.profile_id, ids, CHUNK, weights=weights)
        for name, codec in (("cachegen", cachegen), ("int8", int8))
    }
    blobs = {}
    for i, chunk in enumerate(kv.chunks(CHUNK)):
        blobs["coded", i] = cachegen.encode(chunk, level)
        blobs["int8", i] = int8.encode(chunk)
        store.put(keys["cachegen"][i], level, blobs["coded", i])
        store.put(keys["int8"][i], 0, blobs["int8", i])
        if i != 2:
            blobs["packed", i] = cachegen.encode(chunk, level, form="packed")
            address = RecordAddress.of(keys["cachegen"][i], Form(CACHEGEN, level, PACKED))
            store.write(address, blobs["packed", i])
    yield store, keys, level, blobs
    store.close()


def forms(level) -> tuple[str, str]:
    """The labels of the coded and the packed form of ``level``."""
    return Form(CACHEGEN, level).label, Form(CACHEGEN, level, PACKED).label


def form_options(store, keys, level, int8_loss):
    def option(form: Form, codec: str, loss: float) -> Option:
        records = [RecordAddress.of(key, form) for key in keys[codec]]
        return Option(form.label, records, store.payload_sizes(records), loss)

    return [
        option(Form(CACHEGEN, level), "cachegen", 1.0),
        option(Form(CACHEGEN, level, PACKED), "cachegen", 1.0),
        option(Form("int8"), "int8", int8_loss),
    ]


def load(store, options, decode_priors):
    controller = FastestController(
        options,
        [CHUNK] * CHUNKS,
        max_loss_pct=1.0,
        prefill_tokens_per_s=1e-3,  # recomputing never wins
        initial_mbps=1000,
        decode_s_per_token=decode_priors,
    )
    got = []
    with open_link(store, bandwidth_mbps=1000) as link:
        stats = stream_load(
            link.source,
            options[0].addresses,
            decode,
            lambda i, kv: got.append(kv),
            controller=controller,
        )
    return stats, got


def same(a, b) -> bool:
    return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_fastest_form_over_a_socket(forms_store):
    store, keys, level, blobs = forms_store
    # int8 loses more than the bound allows; the coded form decodes far slower than packed
    options = form_options(store, keys, level, int8_loss=5.0)
    coded, packed = forms(level)
    stats, got = load(store, options, {coded: 1.0, packed: 1e-6, "int8": 1e-9})
    assert stats.forms == [packed, packed, coded, packed]  # chunk 2 has no packed
    assert [c.form for c in stats.chunks] == [packed, packed, coded, packed]
    for i, kv in enumerate(got):  # the packed form decodes to the coded form's KV, bit for bit
        assert same(kv, decode(blobs["coded", i]))
    assert [d["choice"] for d in stats.decisions] == stats.forms

    options = form_options(store, keys, level, int8_loss=0.5)  # now int8 is allowed
    stats, got = load(store, options, {coded: 1.0, packed: 1.0, "int8": 1e-9})
    assert stats.forms == ["int8"] * CHUNKS and [c.form for c in stats.chunks] == ["int8"] * CHUNKS
    for i, kv in enumerate(got):
        assert same(kv, decode(blobs["int8", i]))
