"""``adaptive`` under a quality bound (``max_loss_pct``): per chunk, the stored form (a cachegen
level coded or packed, int8, fp8, raw) or recomputation predicted to finish the load soonest,
among the forms whose loss is within the bound.

* a transport on the tiny model (no engine): the forms it offers, what its loads teach it about
  each form (decode priors, host ceilings) reaching the controller, a bound no form meets;
* SmolLM2 in vLLM (it has a shipped calibration and measured int8 loss): the report's choices
  are stored forms within the bound, and the answer is that of the fixed form chosen.
"""

from __future__ import annotations

import pytest
import torch

from cachegen.codec.form_loss import form_losses
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.connector.load_control import controller_of
from cachegen.connector.load_plan import plan_load
from cachegen.connector.transport import ChunkTransport
from cachegen.extract import extract_kv
from cachegen.modes import PACKED, Form
from cachegen.profiles import codec_for
from cachegen.store import RecordAddress
from cachegen_lab.connector.options import LabRequestOptions
from tests.support import CHUNK, connector_engine, generate_with_params

CHUNKS = 2
# Recomputation priced far above any load here, so that the choice is among stored forms.
SLOW_PREFILL_TOKENS_PER_S = 10.0
MAX_TOKENS = 12


# ---- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, "1", True, float("nan"), float("inf"), None])
def test_a_bad_max_loss_pct_is_refused_per_request_and_engine_wide(bad):
    params = {"mode": "adaptive", "max_loss_pct": bad}
    if bad is None:
        with pytest.raises(ConnectorError, match="needs slo_ms .* or max_loss_pct"):
            RequestOptions().override(params)
        return
    with pytest.raises(ConnectorError, match="max_loss_pct must be a number >= 0"):
        RequestOptions().override(params)
    with pytest.raises(ConnectorError, match="max_loss_pct must be a number >= 0"):
        ConnectorConfig.from_extra_config(params)


def test_a_loss_bound_stands_in_for_the_slo():
    config = ConnectorConfig.from_extra_config({"mode": "adaptive", "max_loss_pct": 1})
    assert (config.defaults.max_loss_pct, config.defaults.slo_ms) == (1, None)
    options = config.defaults.override({"max_loss_pct": 0.5})
    assert options.max_loss_pct == 0.5


# ---- the transport, on the tiny model -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_saved(tiny_llama, tmp_path_factory):
    """A transport storing two chunks at the default cachegen level coded and packed, int8 and
    raw."""
    level = codec_for("cachegen", tiny_llama).default_level
    config = ConnectorConfig.from_extra_config(
        {
            "store": tmp_path_factory.mktemp("forms-store").as_uri(),
            "chunk_tokens": CHUNK,
            "save_modes": ["cachegen", "int8", "raw"],
            "cachegen_levels": [level, Form("cachegen", level, PACKED).label],
            "prefill_tokens_per_s": SLOW_PREFILL_TOKENS_PER_S,
        }
    )
    t = ChunkTransport(config, tiny_llama, tiny_llama.identity())
    ids = list(range(3, 3 + CHUNKS * CHUNK))
    t.save(ids, extract_kv(tiny_llama, token_ids=torch.tensor(ids)), config.save_modes)
    yield t, ids
    t.close()


def test_the_stored_forms_are_every_level_and_codec_with_their_own_keys(tiny_saved):
    t, ids = tiny_saved
    plan = t.parts.load_plan(0, CHUNKS, CHUNKS * CHUNK, _bound(5))
    forms = t.index.stored_options(ids, plan, None)
    names = [f.label for f in t.forms("cachegen")]
    assert any(name.endswith("-packed") for name in names)
    assert sorted(f.name for f in forms) == sorted([*names, "int8", "raw"])
    by_name = {f.name: f for f in forms}
    for name, option in by_name.items():  # each form's records, under its own codec's keys
        codec = Form.parse(name).codec
        assert option.addresses == [RecordAddress.of(key, name) for key in t.keys(codec, ids)]
    assert t.keys("raw", ids) != t.keys("int8", ids)
    assert all(size and size > 0 for f in forms for size in f.sizes)
    assert by_name["raw"].sizes[0] > by_name["int8"].sizes[0]
    # the tiny model has no calibration and no measured int8 loss: only raw is known
    assert {f.name: f.loss_pct for f in forms} == form_losses(by_name, t.identity.fingerprint)
    assert {n for n, f in by_name.items() if f.loss_pct is not None} == {"raw"}


def test_a_bound_no_stored_form_meets_recomputes_and_says_why(tiny_llama, tmp_path):
    config = ConnectorConfig.from_extra_config(
        {"store": tmp_path.as_uri(), "chunk_tokens": CHUNK, "save_modes": ["cachegen", "int8"]}
    )
    t = ChunkTransport(config, tiny_llama, tiny_llama.identity())
    try:
        ids = list(range(3, 3 + CHUNKS * CHUNK))
        t.save(ids, extract_kv(tiny_llama, token_ids=torch.tensor(ids)), config.save_modes)
        got: list[int] = []
        result = t.load(ids, 0, CHUNKS, _bound(100), lambda kv: got.append(kv.start))
        assert result.chunks_loaded == 0 and got == []
        assert "max_loss_pct=100" in result.error and "no option has a loss" in result.error
        stored = {"int8", *(f.label for f in t.forms("cachegen"))}
        assert set(result.stats["form_loss_pct"]) == stored
    finally:
        t.close()


def test_earlier_loads_give_each_form_its_decode_prior_and_host_ceiling(tiny_saved):
    t, ids = tiny_saved
    got: list[int] = []
    fixed = t.load(ids, 0, CHUNKS, RequestOptions(mode="raw"), lambda kv: got.append(kv.start))
    assert fixed.error is None and got == [0, CHUNK]
    decode = t.history.decode_s_per_token["raw"]
    assert decode > 0
    # an unlimited link: the load's goodput (bytes over its whole load, which outlasts its
    # transfer) is what the host reached
    assert 0 < t.history.host_mbps["raw"] <= fixed.stats["goodput_mbps"]
    plan = plan_load(t.index, ids, 0, CHUNKS * CHUNK, _bound(0))
    controller = controller_of(plan, CHUNK, SLOW_PREFILL_TOKENS_PER_S, None, t.history.priors())
    assert controller.allowed == ["raw"]  # the one form of known loss 0
    assert controller.decode_spt["raw"] == decode
    assert controller._host_bps["raw"] == t.history.host_mbps["raw"] * 1e6 / 8

    got.clear()
    result = t.load(ids, 0, CHUNKS, _bound(0), lambda kv: got.append(kv.start))
    assert result.error is None and got == [0, CHUNK]
    assert result.stats["forms"] == ["raw", "raw"]
    assert [d["choice"] for d in result.stats["decisions"]] == ["raw", "raw"]
    # the earlier load on this link gave the throughput prior: every choice has a prediction
    assert all(d["predicted_s"] > 0 for d in result.stats["decisions"])


def _bound(max_loss_pct: float, bandwidth_mbps: float | None = None) -> RequestOptions:
    return LabRequestOptions(
        mode="adaptive", max_loss_pct=max_loss_pct, bandwidth_mbps=bandwidth_mbps
    )


# ---- SmolLM2 in vLLM ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(smollm2, tmp_path_factory):
    """SmolLM2 saving its default save ladder (the default level coded and packed) and int8."""
    with connector_engine(
        smollm2,
        tmp_path_factory.mktemp("smollm2-forms").as_uri(),
        save_modes=("cachegen", "int8"),
        prefill_tokens_per_s=SLOW_PREFILL_TOKENS_PER_S,
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def stored_prompt(engine, text_ids):
    ids = text_ids(engine, CHUNKS * CHUNK + 40, offset=50_000)
    engine.store_prefix(ids)
    return ids


def _choices(report: dict) -> list[str]:
    return [d["choice"] for d in report["decisions"]]


def test_a_bound_loads_stored_forms_within_it_and_answers_like_that_form(engine, stored_prompt):
    ids = stored_prompt
    default = engine.transport.codec("cachegen").default_level
    coded, packed = f"cachegen-{default}", f"cachegen-{default}-packed"

    # int8 (measured +0.11% perplexity) is the only stored form within 0.5%
    tokens, report = generate_with_params(
        engine, ids, {"mode": "adaptive", "max_loss_pct": 0.5}, MAX_TOKENS
    )
    assert "load_error" not in report and report["loaded_tokens"] == CHUNKS * CHUNK
    losses = report["form_loss_pct"]
    assert losses["int8"] <= 0.5 < losses[coded] == losses[packed]
    assert _choices(report) == report["forms"] == ["int8"] * CHUNKS
    assert tokens == engine.run(ids, mode="int8", max_tokens=MAX_TOKENS).token_ids

    # within 1%: the default level too; on a slow link its fewer bytes win
    tokens, report = generate_with_params(
        engine, ids, {"mode": "adaptive", "max_loss_pct": 1, "bandwidth_mbps": 20}, MAX_TOKENS
    )
    assert "load_error" not in report and report["loaded_tokens"] == CHUNKS * CHUNK
    losses = report["form_loss_pct"]
    allowed = {name for name, loss in losses.items() if loss is not None and loss <= 1}
    assert allowed == {coded, packed, "int8"}
    assert set(_choices(report)) <= {coded, packed}  # both decode to the same KV
    assert all(d["predicted_s"] > 0 for d in report["decisions"])  # the link's rate is a prior
    cachegen = engine.run(ids, mode="cachegen", bandwidth_mbps=20, max_tokens=MAX_TOKENS)
    assert tokens == cachegen.token_ids


def test_a_bound_no_stored_form_meets_is_recomputed_with_the_reason(engine, stored_prompt):
    tokens, report = generate_with_params(
        engine, stored_prompt, {"mode": "adaptive", "max_loss_pct": 0}, MAX_TOKENS
    )
    assert report["loaded_tokens"] == 0
    assert "max_loss_pct=0" in report["load_error"]
    assert "no option has a loss" in report["load_error"]
    assert tokens == engine.run(stored_prompt, max_tokens=MAX_TOKENS).token_ids


def test_a_bad_bound_is_reported_and_the_prompt_computed(engine, stored_prompt):
    tokens, report = generate_with_params(
        engine, stored_prompt, {"mode": "adaptive", "max_loss_pct": -1}, MAX_TOKENS
    )
    assert "max_loss_pct must be a number >= 0" in report["error"]
    assert "loaded_tokens" not in report
    assert tokens == engine.run(stored_prompt, max_tokens=MAX_TOKENS).token_ids


def test_the_ttft_table_names_the_bound_packed_levels_and_forms_chosen():
    from cachegen_lab.bench.ttft import markdown

    def row(mode, level, ttft_s, levels=None):
        return {
            "context_tokens": 512,
            "prompt_tokens": 520,
            "repeats": 1,
            "shaper": "token-bucket",
            "mode": mode,
            "level": level,
            "bandwidth_mbps": None if mode == "recompute" else 100.0,
            "ttft_s": ttft_s,
            "bytes": None if mode == "recompute" else 1000,
            "levels": levels,
            "slo_ms": 1000.0 if mode == "adaptive" else None,
        }

    rows = [
        row("recompute", None, 2.0),
        row("cachegen", Form("cachegen", 11, PACKED).label, 1.0),
        row("adaptive", None, 0.5, ["cachegen-11", "int8", "cachegen-11"]),
    ]
    text = markdown(rows, max_loss_pct=1)
    assert "| cachegen level 11 packed |" in text
    assert "adaptive (fastest form within 1% loss)" in text and "SLO" not in text
    assert "levels cachegen-11 x2, int8 x1" in text
    assert "adaptive (SLO 1000 ms)" in markdown(rows)
