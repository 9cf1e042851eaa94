"""Gemma 3 270M through the connector with vLLM's hybrid KV cache manager (HMA) on.

With HMA on, vLLM gives Gemma's full-attention layers one KV cache group and its sliding-window
layers (window 512) groups of their own, whose blocks behind the window are the null block.
One plain vLLM engine (HMA on, no connector) and then one engine with the connector (HMA on,
vLLM's default for a ``SupportsHMA`` connector), at about 4,096 tokens:

* a prefix of 3,840 tokens (15 chunks) stored by a first request and loaded raw by a second
  request of 4,096 tokens answers as the recomputation does (``assert_answers_alike``), with
  the window-aware load (sliding parts of the window's two chunks only) and without it (every
  sliding part fetched, written only into the blocks the sliding groups keep);
* the loaded request holds, per KV cache group, as many blocks as plain vLLM holds for the same
  prompt, and far fewer layer-blocks than HMA off would (every token of every layer);
* the bytes loaded stay window-aware, as in test_gemma.py's window-aware tests;
* a corrupt chunk makes vLLM recompute the request (with several KV cache groups a failed load
  is reported per request, not per block).

The measure of blocks held: when vLLM frees a request, the blocks its table holds in each group
that are not the null block, after dropping those behind the window as vLLM does before it
hands them to a connector (``remove_skipped_blocks``).
"""

from __future__ import annotations

import gc
import math

import pytest

from tests.connector.test_gemma import ANSWER, _prompt_pair
from tests.support import CHUNK, ENGINE_DTYPE, connector_engine, corrupt_raw_chunk

CONTEXT = 3840  # tokens of the stored prefix: 15 chunks
PROMPT = 4096  # tokens of the request that loads it
WINDOW = 512
MAX_MODEL_LEN = PROMPT + 128


def _record_held_blocks(scheduler) -> list[list[int]]:
    """Per freed request, in order: its non-null blocks in each KV cache group."""
    manager = scheduler.kv_cache_manager
    free = manager.free
    held: list[list[int]] = []

    def recording_free(request) -> None:
        manager.remove_skipped_blocks(
            request_id=request.request_id,
            processed_computed_tokens=max(
                0, request.num_computed_tokens - request.num_in_flight_tokens
            ),
            num_prompt_tokens=request.num_prompt_tokens,
        )
        groups = manager.get_block_ids(request.request_id)
        held.append([sum(block != 0 for block in ids) for ids in groups])
        free(request)

    manager.free = recording_free
    return held


def _groups(scheduler) -> list[tuple[str, int, int]]:
    """(spec class, layers, block size) of each KV cache group."""
    return [
        (type(g.kv_cache_spec).__name__, len(g.layer_names), g.kv_cache_spec.block_size)
        for g in scheduler.kv_cache_config.kv_cache_groups
    ]


def _layer_blocks(held: list[int], groups: list[tuple[str, int, int]]) -> int:
    """Blocks held weighted by their group's layers: KV memory in one layer's blocks."""
    return sum(blocks * layers for blocks, (_, layers, _) in zip(held, groups, strict=True))


@pytest.fixture(scope="module")
def prompts(gemma3, doc_text):
    return _prompt_pair(gemma3, doc_text[:60_000], CONTEXT, PROMPT)


@pytest.fixture(scope="module")
def plain(gemma3, prompts) -> dict:
    """Plain vLLM with HMA on (its default on CPU), no prefix cache, answering the second
    prompt: its KV cache groups and the blocks the request held."""
    from vllm import LLM, SamplingParams

    from cachegen_lab.bench.engine import llvmlite_hidden_from_vllm

    with llvmlite_hidden_from_vllm():
        llm = LLM(
            model=str(gemma3.path),
            gpu_memory_utilization=0.3,
            max_model_len=MAX_MODEL_LEN,
            enforce_eager=True,
            dtype=ENGINE_DTYPE,
            enable_prefix_caching=False,
        )
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        held = _record_held_blocks(scheduler)
        params = SamplingParams(temperature=0.0, max_tokens=ANSWER, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
        return {"groups": _groups(scheduler), "held": held[-1]}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()  # free it before the connector's engine starts (reference cycles)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hma-store")


@pytest.fixture(scope="module")
def engine(gemma3, store_dir, plain):
    store = store_dir.as_uri()
    with connector_engine(gemma3, store, save_modes=("raw",), max_model_len=MAX_MODEL_LEN) as eng:
        scheduler = eng.llm.llm_engine.engine_core.engine_core.scheduler
        eng.held_blocks = _record_held_blocks(scheduler)
        eng.groups = _groups(scheduler)
        yield eng


@pytest.fixture(scope="module")
def stored(engine, prompts):
    engine.store_prefix(prompts[0])
    return prompts[0]


@pytest.fixture(scope="module")
def text(engine, prompts):
    """The second prompt computed from text by this engine (nothing loaded nor saved)."""
    return engine.run(prompts[1], max_tokens=ANSWER, margins=True)


@pytest.fixture(scope="module")
def hits(engine, stored, prompts, text) -> dict:
    """The second prompt with its prefix loaded raw, window-aware (True) and not (False):
    ``{skip: (measurement, blocks held per group)}``."""
    out = {}
    for skip in (True, False):
        hit = engine.run(
            prompts[1], mode="raw", max_tokens=ANSWER, margins=True, skip_out_of_window=skip
        )
        out[skip] = (hit, engine.held_blocks[-1])
    return out


def test_the_engine_keeps_hma_on_with_full_and_sliding_groups(engine):
    config = engine.llm.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    kinds = [kind for kind, _, _ in engine.groups]
    assert len(kinds) > 1
    assert set(kinds) == {"FullAttentionSpec", "SlidingWindowSpec"}
    assert sum(layers for _, layers, _ in engine.groups) == 18


@pytest.mark.parametrize("skip", [True, False], ids=["window-aware", "every-part"])
def test_raw_loads_answer_like_recomputation(hits, text, skip, assert_answers_alike):
    hit, _ = hits[skip]
    report = hit.connector
    assert "load_error" not in report and "error" not in report
    assert hit.cached_tokens == CONTEXT and report["loaded_tokens"] == CONTEXT
    assert report["forms"] == ["raw"] * (CONTEXT // CHUNK)
    assert_answers_alike(hit, text)


def test_the_request_holds_plain_vllms_blocks(hits, engine, plain):
    assert engine.groups == plain["groups"]
    _, held = hits[True]
    print("blocks held per group, connector / plain:", held, plain["held"], engine.groups)
    assert held == plain["held"]
    # HMA off: one group in which every layer keeps every token of the request.
    (_, _, block_size), layers = engine.groups[0], sum(n for _, n, _ in engine.groups)
    off = math.ceil((PROMPT + ANSWER - 1) / block_size) * layers
    on = _layer_blocks(held, engine.groups)
    print("layer-blocks held, HMA on / off:", on, off)
    assert on < 0.4 * off


def test_loads_stay_window_aware(hits):
    on, off = hits[True][0].connector, hits[False][0].connector
    window_chunks = -(-WINDOW // CHUNK)
    assert on["window_skipped_chunks"] == CONTEXT // CHUNK - window_chunks
    assert off["window_skipped_chunks"] == 0
    print("raw bytes on/off:", on["bytes"], off["bytes"], on["bytes"] / off["bytes"])
    # Full-attention layers (3 of 18) of every chunk, sliding layers of the window's chunks.
    chunks = CONTEXT // CHUNK
    expected = (3 * chunks + 15 * window_chunks) / (18 * chunks)
    assert on["bytes"] / off["bytes"] == pytest.approx(expected, abs=0.03)


def test_a_corrupt_chunk_is_recomputed(engine, store_dir, doc_text, assert_answers_alike):
    ids = engine.tokenize(doc_text[70_000:80_000])[:600]
    engine.store_prefix(ids)
    text = engine.run(ids, max_tokens=8, margins=True)
    corrupt_raw_chunk(engine, store_dir, ids, 1)
    hit = engine.run(ids, mode="raw", max_tokens=8, margins=True)
    assert "ChunkCorrupt" in hit.connector["load_error"]
    assert_answers_alike(hit, text)
