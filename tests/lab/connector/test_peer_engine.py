"""The lab connector stores and loads LMCache's CacheGen (``lmcache-cachegen``) through vLLM.

SmolLM2 in vLLM's CPU build, one engine saving only the peer's form: a prompt's chunks are
encoded by LMCache's encoder, stored, fetched over an emulated link, decoded by LMCache's
decoder and injected; the engine's next token is the one transformers predicts from the same
decoded KV (the offline quality path), so what vLLM continues from is LMCache's KV.
"""

from __future__ import annotations

import pytest
import torch

from cachegen import workload
from cachegen.codec import decode, inspect
from cachegen.extract import load_model
from cachegen.fitting.replay import continuation_logits
from cachegen.kv import KVCache
from cachegen.modes import Form, Mode
from cachegen.store import RecordAddress
from cachegen_lab.peers import LMCACHE_CACHEGEN
from tests.support import CHUNK, connector_engine

QUESTION = " Question: what is the main point of the text above? Answer:"
CONTEXT_TOKENS = 2 * CHUNK


@pytest.fixture(scope="module")
def engine(smollm2, tmp_path_factory):
    store = tmp_path_factory.mktemp("peer-store").as_uri()
    with connector_engine(smollm2, store, save_modes=(LMCACHE_CACHEGEN,)) as eng:
        yield eng


def _prompt(engine, offset: int) -> list[int]:
    text = workload.text("eval")[offset : offset + 12 * CONTEXT_TOKENS]
    return engine.tokenize(text)[:CONTEXT_TOKENS] + engine.tokenize(QUESTION, bos=False)


def _stored(engine, ids: list[int]) -> list[bytes]:
    transport = engine.transport
    keys = transport.keys(LMCACHE_CACHEGEN, ids)
    return [transport.store.read(RecordAddress.of(key, Form(LMCACHE_CACHEGEN))) for key in keys]


def test_the_peer_is_a_mode_of_the_lab():
    assert Mode.parse(LMCACHE_CACHEGEN).form == Form(LMCACHE_CACHEGEN)


def test_peer_chunks_load_through_vllm_and_answer_from_lmcaches_kv(engine, smollm2):
    ids = _prompt(engine, 12_000)
    engine.store_prefix(ids)
    blobs = _stored(engine, ids)
    assert len(blobs) == CONTEXT_TOKENS // CHUNK
    assert {inspect(blob)["codec"] for blob in blobs} == {LMCACHE_CACHEGEN}
    hit = engine.run(ids, mode=LMCACHE_CACHEGEN, bandwidth_mbps=1000.0, max_tokens=2)
    assert hit.connector["loaded_tokens"] == CONTEXT_TOKENS
    assert hit.connector["forms"] == [LMCACHE_CACHEGEN] * len(blobs)
    assert hit.connector["bytes"] == sum(map(len, blobs))
    hf_model, _, _ = load_model(smollm2)
    decoded = KVCache.concat([decode(blob) for blob in blobs])
    with torch.inference_mode():
        logits = continuation_logits(hf_model, [decoded], torch.tensor(ids[CONTEXT_TOKENS:]))
    assert int(logits[0, -1].argmax()) == hit.token_ids[0]
