"""The connector at tensor parallelism 2 in vLLM's CPU build: two worker processes, each
holding one of tiny-llama's two KV heads, with one directory store that holds the model's KV
(every head in each chunk). A TP 2 engine loads what it stored and what a TP 1 engine stored,
and a TP 1 engine loads what the TP 2 engine stored; each answer is compared with its own TP
size's recomputation (TP 2 splits the attention's reductions, so its logits differ from TP 1's
by rounding).

tiny-llama's random weights answer alike whatever the KV (it repeats one token), so the KV
itself is checked too: the chunks TP 2 stored against transformers' K/V, and what TP 2's
ranks wrote into their caches from a load (saved back out as int8) against the loaded chunks.
Each engine starts once (in the module's one fixture); the tests read what it recorded.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from tests.support import connector_engine

# vLLM's CPU workers each bind their OpenMP threads to their own cores; "auto" needs a NUMA
# node per worker, which a 2-core machine does not have.
TP2_THREADS_BIND = "0|1"


@contextmanager
def _env(**values: str):
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _stored_kv(engine, ids, mode):
    """The KV of ``ids``'s whole chunks as the engine stored them in ``mode``."""
    from cachegen.codec import decode
    from cachegen.kv import KVCache
    from cachegen.modes import Form
    from cachegen.store import RecordAddress

    transport, form = engine.transport, Form(mode)  # raw or int8: a codec of one form
    records = [RecordAddress.of(k, form) for k in transport.keys(mode, ids)]
    return KVCache.concat([decode(transport.store.read(r)) for r in records])


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory, text_ids):
    store = tmp_path_factory.mktemp("tp-store").as_uri()
    runs = {}
    with connector_engine(tiny_llama, store) as tp1:
        by_tp1 = text_ids(tp1, 600)
        by_tp2 = text_ids(tp1, 600, offset=30_000)
        tp1.store_prefix(by_tp1)
        runs["tp1 text of tp2's prompt"] = tp1.run(by_tp2, margins=True)
        runs["tp1 raw kv"] = _stored_kv(tp1, by_tp1, "raw")
    # The TP 2 engine also saves int8: a raw hit on what TP 1 stored then stores int8 chunks
    # read out of its own cache, so they show what each rank's load wrote there.
    with (
        _env(VLLM_CPU_OMP_THREADS_BIND=TP2_THREADS_BIND),
        connector_engine(
            tiny_llama, store, tensor_parallel_size=2, save_modes=("raw", "int8")
        ) as tp2,
    ):
        runs["tp2 text"] = tp2.run(by_tp2, margins=True)
        tp2.store_prefix(by_tp2)
        runs["tp2 stored chunks"] = tp2.stored_chunks(by_tp2)
        runs["tp2 raw kv"] = _stored_kv(tp2, by_tp2, "raw")
        runs["tp2 hit"] = tp2.run(by_tp2, mode="raw", margins=True)
        runs["tp2 text of tp1's prompt"] = tp2.run(by_tp1, margins=True)
        runs["tp2 hit of tp1's prompt"] = tp2.run(by_tp1, mode="raw", save=True, margins=True)
        tp2.wait_stored(by_tp1)
        runs["tp2 int8 kv of tp1's prompt"] = _stored_kv(tp2, by_tp1, "int8")
    with connector_engine(tiny_llama, store) as tp1:
        runs["tp1 hit of tp2's prompt"] = tp1.run(by_tp2, mode="raw", margins=True)
    runs["tp2's prompt"] = by_tp2
    return runs


def _head_errors(got, want) -> list[float]:
    """Relative error of each (layer, head) of keys and values."""
    errors = []
    for a, b in ((got.keys, want.keys), (got.values, want.values)):
        a, b = a.float().flatten(2), b.float().flatten(2)
        errors += ((a - b).norm(dim=2) / b.norm(dim=2)).flatten().tolist()
    return errors


def test_tp2_stores_every_heads_kv(runs, tiny_llama):
    """The oracle: the chunks the TP 2 engine stored hold transformers' K/V of both heads."""
    from cachegen.extract import extract_kv

    ref = extract_kv(tiny_llama, token_ids=runs["tp2's prompt"][:512])
    assert max(_head_errors(runs["tp2 raw kv"], ref)) < 0.03


def test_each_tp2_rank_writes_its_own_heads_of_a_load(runs):
    """What the TP 2 engine's cache held after loading TP 1's raw chunks (read back out as
    int8 chunks) is TP 1's KV, head for head, within int8's rounding."""
    assert max(_head_errors(runs["tp2 int8 kv of tp1's prompt"], runs["tp1 raw kv"])) < 0.03


def test_tp2_raw_loads_answer_as_its_recomputation(runs, assert_answers_alike):
    hit = runs["tp2 hit"]
    assert runs["tp2 stored chunks"] == 2  # 600 tokens hold two whole 256-token chunks
    assert hit.connector["loaded_tokens"] == 512 and hit.cached_tokens == 512
    assert "load_error" not in hit.connector
    assert_answers_alike(hit, runs["tp2 text"])


def test_tp2_loads_what_tp1_stored(runs, assert_answers_alike):
    hit = runs["tp2 hit of tp1's prompt"]
    assert hit.connector["loaded_tokens"] == 512
    assert_answers_alike(hit, runs["tp2 text of tp1's prompt"])


def test_tp1_loads_what_tp2_stored(runs, assert_answers_alike):
    hit = runs["tp1 hit of tp2's prompt"]
    assert hit.connector["loaded_tokens"] == 512
    assert_answers_alike(hit, runs["tp1 text of tp2's prompt"])
