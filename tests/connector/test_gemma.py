"""Gemma 3 270M through the connector in vLLM's CPU build, and what the connector refuses.

Gemma 3 mixes sliding-window layers (window 512) with full-attention layers and has one KV
head of head_dim 256. The connector serves it with vLLM's hybrid KV cache manager (HMA) on
(tests/connector/test_hma.py) and off; this module's engine runs with HMA off, in which all
its layers keep every token in one KV cache group.

* without an engine: vLLM's own config code keeps HMA on for the connector (it is
  ``SupportsHMA``); the connector's start-up checks accept vLLM's grouping of Gemma's layers
  with HMA on and off and refuse a group of another attention kind, a sliding-window-only
  group and an unknown attention kind, with the remedy, before the store is opened; the
  layouts move Gemma's K/V exactly as vLLM's kernels place them;
* with one module-scoped engine (after two plain vLLM engines, one after the other): the K/V the
  connector stores equal transformers' on every layer over 1,024 tokens, twice the window; a
  1,280-token prompt whose first 1,024 tokens are loaded raw answers with plain vLLM's tokens,
  with log-probabilities bit-identical to vLLM reusing its own prefix cache; int8, cachegen
  and adaptive load the same prefix; a corrupt chunk is recomputed;
* window-aware transfer: each chunk is stored as two records (full-attention layers, sliding
  layers), and a load fetches the sliding part only of the chunks within the window before the
  prefix's end (``skip_out_of_window``): without an engine, the choice of chunks, the lookup
  shortened to what is loadable, and one record per chunk for models without sliding layers;
  with the engine, the 1,024-token prefix (four chunks, twice the window) loaded raw with the
  option on (the default) and off answers with plain vLLM's tokens and the same
  log-probabilities bit for bit either way, the option on fetching fewer bytes.

Every engine here runs in ``tests.support.ENGINE_DTYPE`` (float32 on CPUs without bf16
instructions), plain vLLM included, so the bit-for-bit comparisons compare like with like.
"""

from __future__ import annotations

import gc
import json
from types import SimpleNamespace

import pytest
import torch

from cachegen.connector.checks import check_kv_cache_config, check_model
from cachegen.connector.errors import ConnectorError
from cachegen.models import attention_windows
from tests.support import (
    CHUNK,
    ENGINE_DTYPE,
    connector_engine,
    connector_transport,
    corrupt_raw_chunk,
    require_cpu_kernel,
)

CONTEXT = 1024  # tokens of the prefix stored by the first request and loaded by the second
WINDOW = 512
PROMPT = 1280  # tokens of the second request: one chunk more than the shared prefix
ANSWER = 16  # greedy tokens compared
QUESTION = " Question: what is the main point of the text above? Answer:"
LAYER = "model.layers.{}.self_attn.attn"


# ---- without an engine: vLLM's HMA decision and the connector's start-up checks -----------------


def _transfer_config(store: str, **extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="CacheGenConnector",
        kv_connector_module_path="cachegen.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store": store, "chunk_tokens": CHUNK, **extra},
    )


def _vllm_config(model_dir, store: str, **engine_args):
    """The VllmConfig an engine would run with (vLLM's own post-init rules; no engine)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir),
        kv_transfer_config=_transfer_config(store),
        max_model_len=4096,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        **engine_args,
    ).create_engine_config()


def _layer_specs(config: dict) -> dict:
    """vLLM's per-layer KV cache specs for a model: full or sliding-window attention."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = {"block_size": 128, "num_kv_heads": 1, "head_size": 256, "dtype": torch.bfloat16}
    return {
        LAYER.format(i): FullAttentionSpec(**common)
        if window is None
        else SlidingWindowSpec(**common, sliding_window=window)
        for i, window in enumerate(attention_windows(config))
    }


def _kv_cache_config_of(groups: list):
    """A synthetic KVCacheConfig holding vLLM ``KVCacheGroupSpec`` groups."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=list(groups))


def _kv_cache_config(groups: list[tuple[list[int], object]]):
    """A synthetic KVCacheConfig of (layer indices, spec) groups."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return _kv_cache_config_of(
        [KVCacheGroupSpec([LAYER.format(i) for i in layers], spec) for layers, spec in groups]
    )


def test_gemma_windows_as_the_connector_reads_them(gemma3):
    windows = check_model(gemma3.config, gemma3.name)
    assert len(windows) == 18
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17]
    assert {w for w in windows if w is not None} == {512}


def test_vllm_keeps_the_hybrid_manager_on_for_the_connector(gemma3, tmp_path):
    """vllm/config/vllm.py: with no preference, HMA stays on for a connector that is
    SupportsHMA; it is off only when asked for."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    store = (tmp_path / "store").as_uri()
    default = _vllm_config(gemma3.path, store)
    assert default.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert KVConnectorFactory.supports_hma_config(default.kv_transfer_config)
    off = _vllm_config(gemma3.path, store, disable_hybrid_kv_cache_manager=True)
    assert off.scheduler_config.disable_hybrid_kv_cache_manager is True

    # What each setting makes of Gemma's layers (vLLM's own grouping): HMA off gives one group
    # in which every layer has a slot for every token; HMA on gives groups of one kind each.
    # The connector serves both.
    try:  # vLLM 0.33 on: kv_cache_planning; 0.32 (the CPU build): kv_cache_utils
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    for config in (default, off):
        config.cache_config.kv_cache_layout = config.cache_config.kv_cache_layout or "LBHNC"
    (one,) = get_kv_cache_groups(off, _layer_specs(gemma3.config))
    assert len(one.layer_names) == 18
    check_kv_cache_config(_kv_cache_config_of([one]))
    on = get_kv_cache_groups(default, _layer_specs(gemma3.config))
    assert len(on) > 1
    check_kv_cache_config(_kv_cache_config_of(on))


def test_groups_of_another_kind_are_refused(gemma3):
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    specs = _layer_specs(gemma3.config)
    local = ChunkedLocalAttentionSpec(
        block_size=128,
        num_kv_heads=1,
        head_size=256,
        dtype=torch.bfloat16,
        attention_chunk_size=512,
    )
    config = _kv_cache_config([([5, 11, 17], specs[LAYER.format(5)]), ([0, 1, 2, 3, 4], local)])
    with pytest.raises(ConnectorError, match="full and sliding-window attention layers only"):
        check_kv_cache_config(config)


def test_one_kv_cache_group_passes(gemma3):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    full = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)
    check_kv_cache_config(_kv_cache_config([(list(range(18)), full)]))
    check_kv_cache_config(None)  # vLLM may build a connector without one


def test_a_sliding_window_only_group_is_refused(gemma3):
    """All layers sliding by one window (e.g. Mistral 7B v0.1) stay one SlidingWindowSpec group
    even with HMA off, and vLLM frees the blocks behind the window."""
    sliding = _layer_specs(gemma3.config)[LAYER.format(0)]
    with pytest.raises(ConnectorError, match="all use sliding-window attention") as refused:
        check_kv_cache_config(_kv_cache_config([(list(range(18)), sliding)]))
    assert "disable_sliding_window=True" in str(refused.value)


def _bad_gemma_config(gemma3) -> dict:
    config = gemma3.config
    config["layer_types"] = list(config["layer_types"])
    config["layer_types"][3] = "chunked_attention"
    return config


def test_an_unknown_attention_kind_is_refused_naming_the_layer(gemma3):
    with pytest.raises(ConnectorError) as refused:
        check_model(_bad_gemma_config(gemma3), "odd-gemma")
    message = str(refused.value)
    assert "cannot serve odd-gemma" in message
    assert "layer 3 uses 'chunked_attention' attention" in message
    assert "without the cachegen kv_transfer_config" in message  # the remedy


def _fake_vllm_config(model_dir, store: str):
    """The parts of a VllmConfig that the connector reads at start-up, for a model of config
    files alone (raw mode: it has no codec profile, which no connector builds)."""
    return SimpleNamespace(
        kv_transfer_config=_transfer_config(store, mode="raw"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=SimpleNamespace(model=str(model_dir), revision=None),
        load_config=SimpleNamespace(download_dir=None),
        cache_config=SimpleNamespace(block_size=128),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
    )


def test_the_connector_refuses_the_model_at_start_up_and_stores_nothing(gemma3, tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from cachegen.connector.connector import CacheGenConnector

    full = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)
    groups = _kv_cache_config([(list(range(18)), full)])
    for name, config in (("good", gemma3.config), ("bad", _bad_gemma_config(gemma3))):
        model_dir = tmp_path / name
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config))
        store = tmp_path / f"{name}-store"
        vllm_config = _fake_vllm_config(model_dir, store.as_uri())
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            if name == "good":
                connector = CacheGenConnector(vllm_config, role, groups)
                connector.shutdown()
                assert store.exists()  # the store is opened once the model is accepted
                continue
            with pytest.raises(ConnectorError, match="layer 3 uses 'chunked_attention'"):
                CacheGenConnector(vllm_config, role, groups)
            assert not store.exists()


# ---- Gemma's geometry in the layouts (1 KV head of head_dim 256), against vLLM's kernel ----------


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
def test_cpu_layout_moves_gemma_kv_like_the_kernel(isa):
    from vllm import _custom_ops as ops

    from cachegen.connector.layouts import CpuPackedLayout, block_slots, probe_cpu_packing

    dtype, heads, block_size, head_dim, num_blocks = torch.bfloat16, 1, 128, 256, 5
    require_cpu_kernel(isa, dtype, 128, 256)
    torch.manual_seed(0)
    blocks = torch.tensor([3, 0, 4])
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    caches, keys, values = [], [], []
    for _ in range(2):  # two layers
        k = torch.randn(len(slots), heads, head_dim).to(dtype)
        v = torch.randn(len(slots), heads, head_dim).to(dtype)
        cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
        key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, head_dim).chunk(
            2, dim=2
        )
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
        caches.append(cache)
        keys.append(k.transpose(0, 1))
        values.append(v.transpose(0, 1))
    keys, values = torch.stack(keys), torch.stack(values)  # [layers, H, n, D]
    layout = CpuPackedLayout(
        block_size, heads, head_dim, *probe_cpu_packing(isa, block_size, head_dim, dtype), isa
    )
    for cache in caches:
        layout.check_cache(cache)
    # whole blocks (the numba path for the vec packing) ...
    got_keys, got_values = layout.read(caches, block_slots(blocks, layout.block_size))
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    rebuilt = [torch.zeros_like(c) for c in caches]
    layout.write(rebuilt, block_slots(blocks, layout.block_size), (keys, values))
    assert all(torch.equal(a, b) for a, b in zip(rebuilt, caches))
    # ... and single tokens in any order
    pick = torch.randperm(len(slots))[:77]
    got_keys, got_values = layout.read(caches, slots[pick])
    assert torch.equal(got_keys, keys[:, :, pick]) and torch.equal(got_values, values[:, :, pick])


@pytest.mark.parametrize("physical_order", [(0, 1, 2, 3), (0, 2, 1, 3)], ids=["HND", "NHD"])
def test_split_layout_moves_gemma_kv_like_flash_attention(physical_order):
    from cachegen.connector.layouts import SplitLayout, block_slots

    heads, block_size, head_dim, num_blocks = 1, 16, 256, 6
    logical = (num_blocks, heads, block_size, 2 * head_dim)
    physical = torch.zeros(tuple(logical[i] for i in physical_order), dtype=torch.bfloat16)
    cache = physical.permute(*[physical_order.index(i) for i in range(4)])
    torch.manual_seed(1)
    blocks = torch.tensor([5, 2])
    keys = torch.randn(1, heads, 2 * block_size, head_dim).to(torch.bfloat16)
    values = torch.randn(1, heads, 2 * block_size, head_dim).to(torch.bfloat16)
    layout = SplitLayout(block_size, heads, head_dim)
    layout.write([cache], block_slots(blocks, layout.block_size), (keys, values))
    # FlashAttention's own reading: K|V split on the last dim, token-major.
    key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    b, o = slots // block_size, slots % block_size
    assert torch.equal(key_cache[b, o].transpose(0, 1), keys[0])
    assert torch.equal(value_cache[b, o].transpose(0, 1), values[0])


# ---- Gemma in a vLLM CPU engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gemma-store")


@pytest.fixture(scope="module")
def level(gemma3) -> int:
    from cachegen.profiles import codec_for

    return codec_for("cachegen", gemma3).default_level


@pytest.fixture(scope="module")
def engine(gemma3, store_dir, level, plain_default, plain_prefix_cache):
    with connector_engine(
        gemma3,
        store_dir.as_uri(),
        save_modes=("raw", "int8", "cachegen"),
        cachegen_levels=[level],  # one level keeps the saves cheap
        disable_hybrid_kv_cache_manager=True,  # one KV cache group (test_hma.py: several)
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def prompts(gemma3, doc_text):
    """The first request (the 1,024-token context + a question) and the second (the same
    context continued to 1,280 tokens + the question): they share exactly 4 whole chunks.
    Tokenized as vLLM does (test_engine_runs_gemma_with_hma_off_and_bos_first)."""
    return _prompt_pair(gemma3, doc_text[:20_000], CONTEXT, PROMPT)


def _prompt_pair(spec, text: str, context: int, prompt: int) -> tuple[list[int], list[int]]:
    """``context`` tokens of ``text`` + the question, and the same text continued to ``prompt``
    tokens + the question: they share exactly the context's tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(spec.path))  # not the model: only its tokens
    ids = tokenizer(text)["input_ids"]
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    first = ids[:context] + question
    second = ids[: prompt - len(question)] + question
    assert len(second) == prompt and second[context] != first[context]
    return first, second


@pytest.fixture(scope="module")
def stored(engine, prompts):
    first, _ = prompts
    engine.store_prefix(first)  # prefill from text, store every save mode, wait for the store
    return first


@pytest.fixture(scope="module")
def recomputed(engine, prompts):
    """This engine answering the second prompt from text (the connector neither loads nor
    saves)."""
    return engine.run(prompts[1], max_tokens=ANSWER)


def _plain_vllm(spec, prompts: list[list[int]], **engine_args) -> dict:
    """Plain vLLM (no kv_transfer_config) in this process answering ``prompts`` in order:
    ``{"kv_cache_groups": n, "runs": [{"token_ids", "logprobs", "cached_tokens"}, ...]}``."""
    from vllm import LLM, SamplingParams

    from cachegen_lab.bench.engine import llvmlite_hidden_from_vllm

    with llvmlite_hidden_from_vllm():
        llm = LLM(
            model=str(spec.path),
            gpu_memory_utilization=0.3,
            max_model_len=2048,
            enforce_eager=True,
            dtype=ENGINE_DTYPE,
            **engine_args,
        )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=ANSWER, ignore_eos=True, logprobs=0)
        runs = []
        for prompt in prompts:
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            tokens = list(out.outputs[0].token_ids)
            logprobs = [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs)]
            runs.append(
                {"token_ids": tokens, "logprobs": logprobs, "cached_tokens": out.num_cached_tokens}
            )
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        return {"kv_cache_groups": len(scheduler.kv_cache_config.kv_cache_groups), "runs": runs}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()  # free it before the next engine starts (reference cycles)


# Plain vLLM runs before the connector's engine starts, one engine after the other (on 2 cores,
# an engine beside another slows both).


@pytest.fixture(scope="module")
def plain_default(gemma3, prompts) -> dict:
    """Plain vLLM as users run it (for Gemma on CPU with the hybrid KV cache manager on),
    answering the second prompt from text."""
    return _plain_vllm(gemma3, [prompts[1]])


@pytest.fixture(scope="module")
def plain_prefix_cache(gemma3, prompts) -> dict:
    """Plain vLLM with the manager off (one KV cache group, as with the connector) and its own
    prefix cache, answering the first prompt and then the second, whose 1,024 shared tokens
    come from vLLM's prefix cache."""
    return _plain_vllm(
        gemma3, list(prompts), disable_hybrid_kv_cache_manager=True, enable_prefix_caching=True
    )


def test_plain_vllm_as_users_run_it_keeps_sliding_and_full_groups(plain_default):
    assert plain_default["kv_cache_groups"] > 1


def test_plain_vllm_with_the_manager_off_hits_its_own_prefix_cache(plain_prefix_cache):
    assert plain_prefix_cache["kv_cache_groups"] == 1
    assert plain_prefix_cache["runs"][0]["cached_tokens"] == 0
    assert plain_prefix_cache["runs"][1]["cached_tokens"] == CONTEXT  # its own cache's hit


def test_engine_runs_gemma_with_hma_off_and_bos_first(engine, gemma3, doc_text):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from cachegen.extract import load_model

    config = engine.llm.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    (group,) = scheduler.kv_cache_config.kv_cache_groups
    assert type(group.kv_cache_spec) is FullAttentionSpec and len(group.layer_names) == 18
    # vLLM's prompts get the same ids as the quality tools', <bos> (id 2) first.
    _, tokenizer, _ = load_model(gemma3)
    text = doc_text[:2000]
    assert engine.tokenize(text) == tokenizer(text)["input_ids"]
    assert engine.tokenize(text)[0] == 2


def test_connector_kv_matches_transformers_past_the_window(engine, gemma3, stored):
    """The oracle on every layer, over 1,024 tokens (twice the sliding window)."""
    from cachegen.codec import decode
    from cachegen.extract import extract_kv
    from cachegen.kv import KVCache
    from cachegen.modes import Form

    transport = engine.transport
    keys = transport.keys("raw", stored)
    assert len(keys) == CONTEXT // CHUNK
    got = KVCache.concat(  # each chunk is two records: full-attention and sliding layers
        [
            KVCache.merge_layers(
                [
                    decode(transport.store.read(record))
                    for record in transport.parts.part_records(key, Form("raw"))
                ]
            )
            for key in keys
        ]
    )
    assert got.layers is None
    assert got.num_tokens == CONTEXT and got.token_ids.tolist() == stored[:CONTEXT]
    ref = extract_kv(gemma3, token_ids=stored[:CONTEXT])
    assert (ref.num_layers, ref.num_kv_heads, ref.head_dim) == (18, 1, 256)
    for layer in range(ref.num_layers):
        for name, a, b in (
            ("K", got.keys[layer], ref.keys[layer]),
            ("V", got.values[layer], ref.values[layer]),
        ):
            for part, span in (("first 512", slice(0, 512)), ("rest", slice(512, CONTEXT))):
                x, y = a[:, span].float(), b[:, span].float()
                error = (x - y).norm() / y.norm()
                # bf16 kernels differ by 1-3% (most with AMX); a layout error gives ~100%.
                assert error < 0.05, f"layer {layer} {name} {part}: relative error {error:.3f}"


def test_every_save_mode_is_stored(engine, stored, level):
    assert engine.stored_chunks(stored, "raw") == CONTEXT // CHUNK
    assert engine.stored_chunks(stored, "int8") == CONTEXT // CHUNK
    assert engine.stored_chunks(stored, "cachegen", level) == CONTEXT // CHUNK


def _check_report(report: dict, cached_tokens: int, mode: str) -> None:
    """The connector's report of a load of the 4 shared chunks (docs/connector.md)."""
    assert (report["schema"], report["version"], report["mode"]) == (
        "cachegen-connector-report",
        2,
        mode,
    )
    assert report["load_planned_tokens"] == report["loaded_tokens"] == CONTEXT
    assert report["chunks"] == CONTEXT // CHUNK and report["bytes"] > 0
    assert "load_error" not in report and "error" not in report
    for key in ("transfer_s", "decode_s", "inject_s", "load_s"):
        assert report[key] >= 0, key
    assert cached_tokens == CONTEXT  # vLLM computed only the other 256 tokens


@pytest.mark.parametrize("mode", ["int8", "cachegen", "adaptive"])
def test_lossy_modes_load_the_prefix(engine, stored, prompts, recomputed, level, mode):
    hit = engine.run(
        prompts[1],
        mode=mode,
        slo_ms=10_000 if mode == "adaptive" else None,
        max_tokens=ANSWER,
    )
    _check_report(hit.connector, hit.cached_tokens, mode)
    forms = ["int8"] * 4 if mode == "int8" else [f"cachegen-{level}"] * 4
    assert hit.connector["forms"] == forms
    # The quantized prefix changes the logits a little, not the answer's start.
    assert hit.token_ids[0] == recomputed.token_ids[0]


@pytest.fixture(scope="module")
def raw_hit(engine, stored, prompts) -> tuple[list[int], list[float], dict, int]:
    """The second prompt answered with its 1,024-token prefix loaded raw: tokens, logprobs,
    the connector's report and vLLM's count of cached tokens."""
    return _hit(engine, prompts[1], mode="raw")


def test_raw_hit_reports_the_loaded_prefix(raw_hit):
    _, _, report, cached = raw_hit
    _check_report(report, cached, "raw")
    assert report["forms"] == ["raw"] * (CONTEXT // CHUNK)


def test_a_corrupt_chunk_is_recomputed(engine, store_dir, doc_text, assert_answers_alike):
    ids = engine.tokenize(doc_text[30_000:40_000])[:600]
    engine.store_prefix(ids)
    text = engine.run(ids, max_tokens=8, margins=True)
    corrupt_raw_chunk(engine, store_dir, ids, 1)
    hit = engine.run(ids, mode="raw", max_tokens=8, margins=True)
    assert "ChunkCorrupt" in hit.connector["load_error"]
    assert hit.connector["loaded_tokens"] == CHUNK  # chunk 0 arrived, chunk 1 is recomputed
    assert_answers_alike(hit, text)


# ---- window-aware transfer: two records per chunk, sliding parts only within the window ---------


def _chunks_in_window(end: int) -> list[int]:
    """Chunks of CHUNK tokens that hold a token of [end - WINDOW, end), by brute force."""
    needed = set(range(max(0, end - WINDOW), end))
    return [j for j in range(-(-end // CHUNK)) if needed & set(range(j * CHUNK, (j + 1) * CHUNK))]


@pytest.mark.parametrize("end", [0, 1, 255, 256, 511, 512, 513, 768, 1000, 1024, 1500, 2048, 2300])
def test_window_chunks_are_exactly_those_intersecting_the_window(end):
    from cachegen.connector.parts import window_chunks

    assert list(window_chunks(end, CHUNK, WINDOW)) == _chunks_in_window(end)


def _random_kv(spec, tokens: int):
    from cachegen.kv import KVCache

    ident = spec.identity()
    shape = (ident.num_layers, ident.num_kv_heads, tokens, ident.head_dim)
    torch.manual_seed(0)
    return KVCache(
        keys=torch.randn(shape).to(torch.bfloat16),
        values=torch.randn(shape).to(torch.bfloat16),
        token_ids=torch.arange(100, 100 + tokens),
        model=ident,
        windows=attention_windows(spec.config),
    )


def test_gemma_chunks_are_stored_as_two_parts_and_loads_skip_out_of_window(gemma3, tmp_path):
    from cachegen.connector.config import RequestOptions
    from cachegen.kv import KVCache
    from cachegen.modes import Form
    from cachegen.store import FULL, SLIDING, RecordAddress

    def record(key: str, part: str) -> RecordAddress:
        return RecordAddress.of(key, Form("raw"), part)

    transport = connector_transport(gemma3, tmp_path)
    try:
        assert transport.parts.split and transport.parts.window == WINDOW
        assert transport.parts.full_layers == (5, 11, 17)
        kv = _random_kv(gemma3, 8 * CHUNK)
        ids = kv.token_ids.tolist()
        transport.save(ids, kv, ["raw"])
        keys = transport.keys("raw", ids)
        listed = sorted(info.key for info in transport.store.list())
        assert listed == sorted(record(k, part).key for k in keys for part in (FULL, SLIDING))
        assert record(keys[0], FULL).key == keys[0] != record(keys[0], SLIDING).key
        on = RequestOptions(mode="raw", skip_out_of_window=True)
        off = RequestOptions(mode="raw", skip_out_of_window=False)
        for end in (2048, 1800, 1024, 600, 300):
            chunks = -(-end // CHUNK)
            plan = transport.parts.load_plan(0, chunks, end, on)
            assert [c for c, part in plan if part == "full"] == list(range(chunks))
            assert [c for c, part in plan if part == "sliding"] == _chunks_in_window(end)
            plan = transport.parts.load_plan(0, chunks, end, off)
            assert [c for c, part in plan if part == "sliding"] == list(range(chunks))

        # A load with the option on fetches fewer bytes, and its parts are the saved KV.
        got: list[KVCache] = []
        result = transport.load(ids, 0, 8, on, got.append, end=2048)
        assert result.error is None and result.chunks_loaded == 8
        assert result.stats["window_skipped_chunks"] == 6
        assert [p.layers for p in got[-2:]] == [(5, 11, 17), transport.parts.sliding_layers]
        merged = KVCache.merge_layers([got[-2], got[-1]])
        assert torch.equal(merged.keys, kv.slice(7 * CHUNK, 8 * CHUNK).keys)
        full = transport.load(ids, 0, 8, off, lambda kv: None, end=2048)
        assert full.stats["window_skipped_chunks"] == 0
        assert result.stats["bytes"] < full.stats["bytes"] < 1.01 * kv.nbytes

        # The lookup counts a prefix only if the sliding parts its load needs are stored.
        assert transport.loadable_tokens(ids, on, 0, 2047) == 2047
        transport.store.remove(record(keys[2], SLIDING))
        assert transport.stored_chunks(ids, on) == 2
        assert transport.loadable_tokens(ids, on, 0, 2047) == 2047  # chunk 2 is out of the window
        assert transport.loadable_tokens(ids, off, 0, 2047) == 2 * CHUNK
        assert transport.loadable_tokens(ids, on, 0, 1000) == 2 * CHUNK  # window 488..999
        transport.store.remove(record(keys[6], SLIDING))
        assert transport.loadable_tokens(ids, on, 0, 2047) == 6 * CHUNK  # window 1024..1535
        assert transport.loadable_tokens(ids, off, 3 * CHUNK, 2047) == 6 * CHUNK
        # A save after a load that skipped sliding parts writes none before the window.
        last = [record(keys[7], FULL), record(keys[7], SLIDING)]
        for address in last:
            transport.store.remove(address)
        transport.save(ids, kv.slice(7 * CHUNK, 8 * CHUNK), ["raw"], sliding_from=8)
        assert transport.store.holds(last) == [True, False]
    finally:
        transport.close()


def test_a_save_without_early_sliding_parts_counts_as_saved(gemma3, tmp_path):
    """A long prefill runs in several steps, and vLLM's hybrid allocator frees the sliding
    blocks behind the window between them, so the save writes no sliding part of the early
    chunks. A load of the prefix fetches none of them either: the save check (and the
    bench's wait for a save) counts the prefix as saved."""
    from cachegen.connector.config import RequestOptions
    from cachegen.modes import Form
    from cachegen.store import SLIDING, RecordAddress

    transport = connector_transport(gemma3, tmp_path)
    try:
        kv = _random_kv(gemma3, 8 * CHUNK)
        ids = kv.token_ids.tolist()
        transport.save(ids, kv, ["raw"], sliding_from=6)
        assert _chunks_in_window(8 * CHUNK) == [6, 7]
        assert transport.stored_chunks(ids, RequestOptions(mode="raw")) == 0  # every part
        assert transport.saved_chunks(ids, ["raw"]) == 8
        assert transport.saved_chunks(ids[: 7 * CHUNK], ["raw"]) == 0  # needs chunk 5's
        key = transport.keys("raw", ids)[7]
        transport.store.remove(RecordAddress.of(key, Form("raw"), SLIDING))
        assert transport.saved_chunks(ids, ["raw"]) == 0
    finally:
        transport.close()


@pytest.mark.parametrize("model", ["tiny_llama", "smollm2"])
def test_models_without_sliding_layers_keep_one_record_per_chunk(model, request, tmp_path):
    from cachegen.connector.config import RequestOptions

    spec = request.getfixturevalue(model)
    transport = connector_transport(spec, tmp_path)
    try:
        assert not transport.parts.split
        kv = _random_kv(spec, 3 * CHUNK)
        ids = kv.token_ids.tolist()
        transport.save(ids, kv, ["raw"])
        keys = transport.keys("raw", ids)
        assert sorted(info.key for info in transport.store.list()) == sorted(keys)
        options = RequestOptions(mode="raw")
        assert transport.stored_chunks(ids, options) == 3
        plan = transport.parts.load_plan(0, 3, 3 * CHUNK, options)
        assert plan == [(0, None), (1, None), (2, None)]
        got = []
        result = transport.load(ids, 0, 3, options, got.append)
        assert result.chunks_loaded == 3 and "window_skipped_chunks" not in result.stats
        assert all(part.layers is None for part in got)
    finally:
        transport.close()


def _hit(engine, prompt: list[int], **params):
    from vllm import SamplingParams

    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=ANSWER,
        ignore_eos=True,
        logprobs=0,
        extra_args={"kv_transfer_params": {"save": False, **params}},
    )
    out = engine.llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    logprobs = [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs)]
    return tokens, logprobs, out.kv_transfer_params["cachegen"], out.num_cached_tokens


def test_window_aware_cachegen_load_fetches_less(engine, stored, prompts, level):
    reports = {}
    for skip in (True, False):
        _, _, report, cached = _hit(engine, prompts[1], mode="cachegen", skip_out_of_window=skip)
        assert cached == CONTEXT and "load_error" not in report
        assert report["forms"] == [f"cachegen-{level}"] * (CONTEXT // CHUNK)
        reports[skip] = report
    assert reports[True]["window_skipped_chunks"] == 2
    assert reports[True]["bytes"] < reports[False]["bytes"]
    print("cachegen bytes on/off:", reports[True]["bytes"], reports[False]["bytes"])


def test_window_measurement_of_the_lab(engine):
    """``cachegen ttft window``'s rows on this engine: raw with the option on answers like
    recompute, and on fetches fewer bytes than off, skipping the chunks behind the window."""
    from cachegen_lab.bench.ttft import TTFTBench
    from cachegen_lab.experiments.window import window_markdown, window_rows

    rows = window_rows(TTFTBench(engine=engine), CONTEXT, ("raw",), output_tokens=8)
    on, off = rows
    assert (on["skip_out_of_window"], off["skip_out_of_window"]) == (True, False)
    assert on["loaded_tokens"] == off["loaded_tokens"] == CONTEXT
    # 1,024 tokens with a 512-token window: chunks 2 and 3 bring their sliding parts.
    assert (on["window_skipped_chunks"], off["window_skipped_chunks"]) == (2, 0)
    assert on["bytes"] < off["bytes"]
    assert on["tokens_equal_recompute"] == on["output_tokens"] == 8
    assert "| raw |" in window_markdown(rows)


def test_window_aware_raw_load_is_exact_and_fetches_less(
    engine, stored, prompts, plain_prefix_cache
):
    """On (the default) and off, the raw load answers with plain vLLM's tokens and the same
    log-probabilities bit for bit, the option on fetching fewer bytes."""
    reused = plain_prefix_cache["runs"][1]
    assert plain_prefix_cache["kv_cache_groups"] == 1 and reused["cached_tokens"] == CONTEXT
    reports, diffs, logprobs_of = {}, {}, {}
    for skip in (False, True):
        tokens, logprobs, report, cached = _hit(
            engine, prompts[1], mode="raw", skip_out_of_window=skip
        )
        assert cached == CONTEXT and report["loaded_tokens"] == CONTEXT
        assert "load_error" not in report and report["chunks"] == CONTEXT // CHUNK
        assert report["forms"] == ["raw"] * (CONTEXT // CHUNK)
        assert tokens == reused["token_ids"], skip
        diffs[skip] = max(abs(a - b) for a, b in zip(logprobs, reused["logprobs"]))
        logprobs_of[skip] = logprobs
        reports[skip] = report
    # Skipping the out-of-window sliding parts changes nothing, bit for bit, and the tokens are
    # plain vLLM's reusing its own prefix cache. (Earlier runs at 2,048 tokens saw its
    # log-probabilities differ by up to 0.10 there, with the option on and off alike.)
    assert logprobs_of[True] == logprobs_of[False]
    assert diffs[False] < 0.2
    # 1,024 tokens with a 512-token window: chunks 2 and 3 bring their sliding parts.
    assert reports[True]["window_skipped_chunks"] == 2
    assert reports[False]["window_skipped_chunks"] == 0
    assert reports[True]["bytes"] < reports[False]["bytes"]
    print(
        "raw bytes on/off:",
        reports[True]["bytes"],
        reports[False]["bytes"],
        "sliding bytes on/off:",
        reports[True]["sliding_bytes"],
        reports[False]["sliding_bytes"],
        "max logprob diff on/off:",
        diffs[True],
        diffs[False],
    )


def test_raw_hit_answers_like_recomputation_and_plain_vllm(raw_hit, recomputed, plain_default):
    tokens = raw_hit[0]
    assert tokens == recomputed.token_ids  # this engine computing the whole prompt
    plain = plain_default["runs"][0]["token_ids"]  # plain vLLM, as users run it
    if ENGINE_DTYPE == "float32":
        assert tokens == plain
    else:
        # Plain vLLM's hybrid manager runs the sliding layers over other KV cache groups, hence
        # other kernels, than the one group here; in bf16 each CPU kind rounds them otherwise
        # (on an AVX512-BF16 EPYC the answers parted at their 7th token). The bit-for-bit
        # comparison with plain vLLM in one group is the next test.
        assert tokens[0] == plain[0]


def test_raw_hit_is_bit_exact_with_vllms_own_prefix_cache(raw_hit, plain_prefix_cache):
    """Raw loads are exact: the log-probabilities are bit for bit those of vLLM reusing its own
    cache of the same prefix (same KV cache grouping)."""
    tokens, logprobs, _, _ = raw_hit
    reused = plain_prefix_cache
    assert reused["kv_cache_groups"] == 1
    assert reused["runs"][1]["cached_tokens"] == CONTEXT  # vLLM's own prefix cache hit
    assert tokens == reused["runs"][1]["token_ids"]
    assert logprobs == reused["runs"][1]["logprobs"], (
        "raw KV is not bit-exact: max log-probability difference "
        f"{max(abs(a - b) for a, b in zip(logprobs, reused['runs'][1]['logprobs']))}"
    )
