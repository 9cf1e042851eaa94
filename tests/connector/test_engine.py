"""The connector inside a real vLLM CPU engine (tiny-llama, local directory store).

Every answer is compared with the same engine answering from text (no connector), which is
the ground truth for raw mode and for every failure that must fall back to recomputation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cachegen.connector.config import RequestOptions
from cachegen.errors import InputError
from cachegen.store import RecordAddress, open_store
from cachegen_lab import rows as row_schema
from cachegen_lab.bench.engine import ConnectorEngine
from tests.support import connector_engine


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("connector-store")


@pytest.fixture(scope="module")
def engine(tiny_llama, store_dir):
    with connector_engine(tiny_llama, store_dir.as_uri()) as eng:
        yield eng


def _stored_files(
    store_dir: Path, engine: ConnectorEngine, ids: list[int], chunk: int
) -> list[Path]:
    key = engine.transport.keys("raw", ids)[chunk]
    files = sorted(store_dir.rglob(f"*{key.split('/')[1]}*/L0*"))
    assert files, f"chunk {chunk} is not in {store_dir}"
    return files


def test_raw_hit_gives_the_same_answer_and_computes_only_the_rest(engine, text_ids):
    ids = text_ids(engine, 600)
    text = engine.run(ids)
    assert text.cached_tokens == 0 and "loaded_tokens" not in text.connector

    assert engine.stored_chunks(ids) == 0
    engine.store_prefix(ids)
    assert engine.stored_chunks(ids) == 2  # 600 tokens hold two whole 256-token chunks

    hit = engine.run(ids, mode="raw")
    assert hit.token_ids == text.token_ids
    assert hit.connector["loaded_tokens"] == 512
    assert hit.cached_tokens == 512  # vLLM computed only the other 88 tokens
    assert hit.connector["bytes"] > 0 and hit.connector["forms"] == ["raw", "raw"]


def test_connector_kv_matches_transformers(engine, tiny_llama, text_ids):
    """The oracle: K/V read out of vLLM's packed CPU cache equal transformers' K/V."""
    from cachegen.codec import decode
    from cachegen.extract import extract_kv
    from cachegen.kv import KVCache
    from cachegen.store import RecordAddress

    ids = text_ids(engine, 520, offset=10_000)
    engine.store_prefix(ids)
    transport = engine.transport
    records = [RecordAddress.of(key, "raw") for key in transport.keys("raw", ids)]
    got = KVCache.concat([decode(transport.store.read(r)) for r in records])
    ref = extract_kv(tiny_llama, token_ids=ids[:512])
    for a, b in ((got.keys, ref.keys), (got.values, ref.values)):
        error = (a.float() - b.float()).flatten(1).norm(dim=1) / b.float().flatten(1).norm(dim=1)
        assert (error < 0.03).all(), f"relative error per layer {error.tolist()}"


def test_partial_prefix_loads_the_stored_chunks_and_computes_the_new_suffix(engine, text_ids):
    context = text_ids(engine, 768, offset=20_000)
    first = context + engine.tokenize(" What does this section describe?", bos=False)
    engine.store_prefix(first)
    second = context + engine.tokenize(" Summarize the rules above in one sentence.", bos=False)
    text = engine.run(second)
    hit = engine.run(second, mode="raw")
    assert hit.connector["loaded_tokens"] == 768
    assert hit.cached_tokens == 768
    assert hit.token_ids == text.token_ids


def test_never_loads_the_whole_prompt(engine, text_ids):
    ids = text_ids(engine, 512, offset=40_000)  # exactly two chunks, both stored
    engine.store_prefix(ids)
    hit = engine.run(ids, mode="raw")
    # vLLM must compute at least one token: the load stops at the last whole block before the end.
    assert hit.connector["loaded_tokens"] == 384
    assert hit.token_ids == engine.run(ids).token_ids


def test_corrupt_chunk_falls_back_to_recomputation(engine, store_dir, text_ids):
    ids = text_ids(engine, 800, offset=60_000)
    engine.store_prefix(ids)
    text = engine.run(ids)
    for path in _stored_files(store_dir, engine, ids, 1):  # flip bytes in the middle of chunk 1
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    hit = engine.run(ids, mode="raw", save=True)
    assert "ChunkCorrupt" in hit.connector["load_error"]
    assert hit.connector["loaded_tokens"] == 256  # chunk 0 arrived, chunks 1-2 are recomputed
    assert hit.token_ids == text.token_ids
    # The damaged chunk was dropped and stored afresh by the recomputation.
    engine.wait_stored(ids, timeout_s=60)
    again = engine.run(ids, mode="raw")
    assert again.connector["loaded_tokens"] == 768 and again.token_ids == text.token_ids


def test_undecodable_chunk_falls_back_to_recomputation(engine, store_dir, text_ids):
    ids = text_ids(engine, 600, offset=80_000)
    engine.store_prefix(ids)
    text = engine.run(ids)
    key = engine.transport.keys("raw", ids)[0]
    with open_store(store_dir.as_uri()) as store:
        # a well-formed record whose payload is no chunk
        store.write(RecordAddress.of(key, "raw"), b"\x00" * 1000)
    hit = engine.run(ids, mode="raw")
    assert hit.connector["load_error"]
    assert hit.connector["loaded_tokens"] == 0
    assert hit.token_ids == text.token_ids


def test_missing_chunk_at_load_time_reports_how_far_it_got(engine, store_dir, text_ids):
    """A chunk evicted between lookup and load: the transport reports the chunks that arrived."""
    ids = text_ids(engine, 800, offset=100_000)
    engine.store_prefix(ids)
    transport = engine.transport
    raw = RequestOptions(mode="raw")
    assert transport.stored_chunks(ids, raw) == 3
    transport.store.delete(transport.keys("raw", ids)[1])
    got = []
    result = transport.load(ids, 0, 3, raw, got.append)
    assert result.chunks_loaded == 1 and "ChunkMissing" in result.error
    assert [kv.start for kv in got] == [0]


def test_bad_request_options_are_reported_and_the_prompt_is_computed(engine, text_ids):
    from vllm import SamplingParams

    ids = text_ids(engine, 300, offset=120_000)
    params = SamplingParams(
        temperature=0.0, max_tokens=4, extra_args={"kv_transfer_params": {"mode": "zip"}}
    )
    out = engine.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert "unknown mode 'zip'" in out.kv_transfer_params["cachegen"]["error"]
    assert list(out.outputs[0].token_ids) == engine.run(ids, max_tokens=4).token_ids


def test_ttft_bench_measures_every_mode_on_one_engine(engine):
    """The measurement entry point `cachegen bench` calls, on this module's engine."""
    from cachegen_lab.bench.ttft import TTFTBench, markdown, ttft_table

    bench = TTFTBench(engine=engine)
    rows = ttft_table(bench, [512], [100], modes=("recompute", "raw"), repeats=1, progress=False)
    row_schema.validate(rows, "ttft", "the TTFT table")
    assert [(r["mode"], r["bandwidth_mbps"]) for r in rows] == [("recompute", None), ("raw", 100)]
    text, raw = rows
    assert (
        raw["loaded_tokens"] == 512 and raw["cached_tokens"] == 512 and text["cached_tokens"] == 0
    )
    assert raw["output_token_ids"] == text["output_token_ids"]
    assert raw["ttft_s"] > 0 and raw["bytes"] > 0 and raw["levels"] == ["raw", "raw"]
    table = markdown(rows)
    assert "| raw |" in table and "100 Mbit/s" in table
    bench.close()  # leaves the module's engine running
    assert engine.run(bench.prompt(300), max_tokens=2).output_tokens == 2


def test_ttft_timeline_splits_ttft_around_the_load(engine):
    from cachegen_lab.bench.ttft import TTFTBench, parse_mode, timeline, timeline_markdown

    bench = TTFTBench(engine=engine)
    rows = timeline(bench, 512, [("recompute", None), ("raw", None)], 100.0, repeats=2)
    row_schema.validate(rows, "timeline", "the TTFT timeline")
    text, raw = rows
    assert (
        text["load_s"] == 0.0 and text["bandwidth_mbps"] is None and raw["bandwidth_mbps"] == 100.0
    )
    assert all(r["loaded_tokens"] == 512 for r in raw["runs"])
    # the load is part of TTFT, and the first token needs steps after the idle ones of the load.
    # first_token_step_s (our clock around engine.step()) is not compared with after_load_s
    # (vLLM's first-token timestamp, taken inside the step, less the connector's load): on
    # different clocks their order is not guaranteed (one CI run: 0.0182 s vs 0.0179 s).
    assert 0 < raw["load_s"] < raw["ttft_s"]
    for run in raw["runs"]:
        assert 0 < run["first_token_step_s"] and 0 < run["after_load_s"] and run["steps"] >= 2
    assert "| raw | 100 |" in timeline_markdown(rows)
    assert parse_mode("cachegen-3") == ("cachegen", 3) and parse_mode("int8") == ("int8", None)
    assert parse_mode("cachegen") == ("cachegen", None) and parse_mode("recompute") == (
        "recompute",
        None,
    )
    with pytest.raises(InputError):
        parse_mode("zip")
    bench.close()
