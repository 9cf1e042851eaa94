"""The transform codec ``tcq`` through the connector in a real vLLM CPU engine (tiny-llama,
directory store): saved at the levels of ``tcq_levels``, loaded by ``mode`` ``tcq`` and
``level``, a level that is not stored recomputed with the reason, and the stored levels among
the forms of ``adaptive`` with a quality bound (their loss unknown, so never allowed).
"""

from __future__ import annotations

import pytest

from cachegen.codec import decode
from cachegen.connector.config import ConnectorConfig
from cachegen.connector.errors import ConnectorError
from cachegen.connector.transport import ChunkTransport
from cachegen.modes import Form, Mode
from cachegen.profiles import codec_for
from cachegen.store import RecordAddress
from cachegen_lab import rows as row_schema
from tests.support import CHUNK, connector_engine, connector_transport

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def levels(tiny_llama) -> list[int]:
    """The cheapest and the finest tcq level of tiny-llama's tcq model."""
    stored = codec_for("tcq", tiny_llama).levels
    return [stored[0], stored[-1]]


@pytest.fixture(scope="module")
def engine(tiny_llama, levels, tmp_path_factory):
    with connector_engine(
        tiny_llama,
        tmp_path_factory.mktemp("connector-tcq").as_uri(),
        save_modes=("raw", "cachegen", "tcq"),  # adaptive finds chunks by a cachegen level
        connector_extra={"tcq_levels": levels},
    ) as eng:
        yield eng


def test_tcq_modes_parse_and_name_their_forms():
    assert Mode.parse("tcq-21") == Mode("tcq", 21) and Mode("tcq", 21).codec_name == "tcq"
    assert Mode("tcq", 21).form == Form("tcq", 21) and Form("tcq", 21).label == "tcq-21"
    config = ConnectorConfig.from_extra_config({"save_modes": ["tcq"], "tcq_levels": [20, 26]})
    assert config.tcq_levels == ("tcq-20", "tcq-26")
    with pytest.raises(ConnectorError, match="tcq_levels must be a non-empty list"):
        ConnectorConfig.from_extra_config({"tcq_levels": 21})
    with pytest.raises(ConnectorError, match="tcq_levels: unknown form .21."):
        ConnectorConfig.from_extra_config({"tcq_levels": ["21"]})


def test_the_bench_stores_the_tcq_levels_it_measures():
    import inspect

    from cachegen_lab.bench.engine import ConnectorEngine
    from cachegen_lab.bench.measure_e2e import connector_options

    modes = [Mode("tcq", 23), Mode("int8"), Mode("tcq", 21)]
    options = connector_options(CHUNK, modes, [11])
    assert options["save_modes"] == ["int8", "tcq"]
    assert options["connector_extra"] == {"tcq_levels": [21, 23]}
    assert set(options) <= set(inspect.signature(ConnectorEngine).parameters)


def test_a_tcq_level_the_model_lacks_is_refused(tiny_llama, tmp_path):
    config = ConnectorConfig.from_extra_config(
        {"store": tmp_path.as_uri(), "save_modes": ["tcq"], "tcq_levels": [99]}
    )
    t = ChunkTransport(config, tiny_llama, tiny_llama.identity())
    try:
        with pytest.raises(ConnectorError, match=r"tcq_levels \['tcq-99'\] are not levels"):
            t.forms("tcq")
    finally:
        t.close()


def test_tcq_levels_are_saved_and_loaded_as_requested(engine, levels, text_ids):
    ids = text_ids(engine, 600, offset=40_000)
    engine.store_prefix(ids)
    transport = engine.transport
    for level in levels:
        keys = transport.keys("tcq", ids)
        assert len(keys) == 2
        blob = transport.store.read(RecordAddress.of(keys[0], Form("tcq", level)))
        assert decode(blob).num_tokens == CHUNK  # a tcq bitstream of the whole chunk
        hit = engine.run(ids, mode="tcq", level=level, max_tokens=MAX_TOKENS)
        assert "load_error" not in hit.connector, hit.connector
        assert hit.connector["loaded_tokens"] == 2 * CHUNK and hit.cached_tokens == 2 * CHUNK
        assert hit.connector["forms"] == [f"tcq-{level}"] * 2
    # the finer level moves more bytes
    small, large = (engine.run(ids, mode="tcq", level=lv).connector["bytes"] for lv in levels)
    assert 0 < small < large


def test_a_tcq_level_that_is_not_stored_recomputes_and_says_why(engine, levels, text_ids):
    ids = text_ids(engine, 600, offset=41_000)
    engine.store_prefix(ids)
    missing = next(lv for lv in codec_for("tcq", engine.spec).levels if lv not in levels)
    text = engine.run(ids, max_tokens=MAX_TOKENS)
    miss = engine.run(ids, mode="tcq", level=missing, max_tokens=MAX_TOKENS)
    assert miss.connector.get("loaded_tokens", 0) == 0
    assert f"not tcq-{missing}" in miss.connector["error"]
    assert miss.token_ids == text.token_ids


def test_stored_tcq_levels_are_forms_of_unknown_loss(engine, levels, text_ids):
    ids = text_ids(engine, 600, offset=42_000)
    engine.store_prefix(ids)
    from vllm import SamplingParams

    params = {"load": True, "save": False, "mode": "adaptive", "max_loss_pct": 0}
    sampling = SamplingParams(
        temperature=0.0, max_tokens=2, extra_args={"kv_transfer_params": params}
    )
    out = engine.llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)[0]
    report = out.kv_transfer_params["cachegen"]
    stored = engine.transport.forms("cachegen")
    # raw (lossless) is the one form a bound of 0 allows; tcq levels are offered, not allowed
    assert report["form_loss_pct"] == {
        **{form.label: None for form in stored},
        "raw": 0.0,
        **{f"tcq-{lv}": None for lv in levels},
    }
    assert set(report["forms"]) == {"raw"} and report["loaded_tokens"] == 2 * CHUNK


def test_a_calibrated_tcq_level_is_a_form_a_bound_allows(tiny_llama, tmp_path, monkeypatch):
    """Once ``cachegen calibrate --codec tcq`` recorded a target for a level, that level is a
    form of that loss: on a slow link, with raw the other allowed form, it is loaded."""
    import torch

    from cachegen.codec.tcq import model as tcq_model
    from cachegen.codec.tcq.levels import write_tcq_levels
    from cachegen.codec.transform import basis as transform
    from cachegen.extract import extract_kv
    from cachegen.fitting.tcq import ensure_tcq_model
    from cachegen.profiles import ensure_profile
    from cachegen_lab.connector.options import LabRequestOptions

    monkeypatch.setenv("CACHEGEN_PROFILE_DIR", str(tmp_path / "profiles"))
    transform.forget_cached_bases()
    tcq_model.forget_cached_tcq_models()
    ensure_profile(tiny_llama)  # `cachegen profile build`: the connector never builds them
    ensure_tcq_model(tiny_llama)
    t = connector_transport(
        tiny_llama,
        tmp_path,
        save_modes=["cachegen", "raw", "tcq"],
        prefill_tokens_per_s=10.0,  # recomputation far slower than any load
    )
    config = t.config
    try:
        (form,) = t.forms("tcq")
        level = form.level
        write_tcq_levels(t.identity, t.codec("tcq").profile_id, {level: 2.0}, None, {})
        ids = list(range(3, 3 + 2 * CHUNK))
        t.save(ids, extract_kv(tiny_llama, token_ids=torch.tensor(ids)), config.save_modes)
        got: list[int] = []
        options = LabRequestOptions(mode="adaptive", max_loss_pct=2, bandwidth_mbps=50)
        result = t.load(ids, 0, 2, options, lambda kv: got.append(kv.start))
        assert result.error is None and got == [0, CHUNK]
        losses = result.stats["form_loss_pct"]
        assert losses[f"tcq-{level}"] == 2.0 and losses["raw"] == 0
        assert result.stats["forms"] == [f"tcq-{level}"] * 2  # far fewer bytes than raw
    finally:
        t.close()
        transform.forget_cached_bases()
        tcq_model.forget_cached_tcq_models()


def test_the_ttft_table_measures_each_stored_tcq_level(engine, levels):
    from cachegen_lab.bench.ttft import TTFTBench, ttft_table

    rows = ttft_table(TTFTBench(engine=engine), [512], [100], modes=("tcq",), repeats=1)
    row_schema.validate(rows, "ttft", "the tcq TTFT table")  # what --json writes
    assert [(r["mode"], r["level"]) for r in rows] == [("tcq", level) for level in levels]
    assert all(r["loaded_tokens"] == 512 and r["bytes"] > 0 for r in rows)
