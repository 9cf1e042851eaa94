"""results.json: the schema accepts what the sweep writes and rejects what it must not."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest

from cachegen.errors import InputError
from cachegen.modes import Form, Mode
from cachegen_lab import rows
from cachegen_lab.bench import results
from cachegen_lab.bench.modes import TcqDefault, expand, tcq_default
from tests.support import FIXTURES

FIXTURE = FIXTURES / "bench_results.json"


@pytest.fixture(scope="module")
def doc() -> dict:
    return json.loads(FIXTURE.read_text())


def test_fixture_follows_the_schema(doc):
    results.validate(doc)
    assert {r["kind"] for r in doc["runs"]} == {"e2e", "stream"}
    assert doc["quality"], "the fixture should exercise every part of the schema"


def test_every_run_has_the_fields_the_issue_lists(doc):
    required = {
        "model",
        "mode",
        "level",
        "bandwidth_mbps",
        "context_tokens",
        "ttft_s",
        "e2e_s",
        "output_tokens_per_s",
        "bytes",
        "ratio_vs_fp16",
        "transfer_s",
        "decode_s",
    }
    assert required <= set(rows.schema()["$defs"]["run"]["required"])
    for run in doc["runs"]:
        assert required <= run.keys()


def test_medians_are_medians_of_the_runs():
    base = {
        "kind": "e2e",
        "model": "m",
        "mode": "int8",
        "level": None,
        "bandwidth_mbps": 100.0,
        "context_tokens": 512,
    }
    runs = [dict(base, repeat=i, ttft_s=t, transfer_s=None) for i, t in enumerate([0.3, 0.1, 2.0])]
    (row,) = results.medians(runs)
    assert row["n"] == 3
    assert row["ttft_s"] == 0.3
    assert row["transfer_s"] is None  # never reported: stays unknown, not zero


def _broken(doc, edit):
    bad = copy.deepcopy(doc)
    edit(bad)
    return bad


@pytest.mark.parametrize(
    "edit, where",
    [
        (lambda d: d["runs"][0].pop("ttft_s"), "runs/0"),
        (lambda d: d["runs"][0].update(mode="turbo"), "runs/0/mode"),
        (lambda d: d["runs"][0].update(bytes=-1), "runs/0/bytes"),
        (lambda d: d["runs"][0].update(level="two"), "runs/0/level"),
        (lambda d: d.update(version=99), "version"),
        (lambda d: d["environment"].pop("git"), "environment"),
        (lambda d: d["config"].update(bandwidth_mbps=[0]), "config/bandwidth_mbps/0"),
        (lambda d: d["quality"][0].update(top1_agreement=1.5), "quality/0/top1_agreement"),
        (lambda d: d.update(extra=1), "(top level)"),
    ],
)
def test_schema_rejects_malformed_documents(doc, edit, where):
    with pytest.raises(results.ResultsError, match=re.escape(f"at {where}:")):
        results.validate(_broken(doc, edit))


def test_medians_must_match_the_runs(doc):
    with pytest.raises(results.ResultsError, match="medians"):
        results.validate(_broken(doc, lambda d: d["runs"].pop()))
    with pytest.raises(results.ResultsError, match="medians"):
        results.validate(_broken(doc, lambda d: d["medians"].pop()))


def test_non_finite_numbers_are_rejected(doc):
    run = next(i for i, r in enumerate(doc["runs"]) if r["ttft_s"] is not None)
    with pytest.raises(results.ResultsError, match="non-finite"):
        results.validate(_broken(doc, lambda d: d["runs"][run].update(ttft_s=math.inf)))


def test_save_and_load_round_trip(doc, tmp_path):
    path = results.save(doc, tmp_path / "sub" / "results.json")
    assert results.load(path) == doc


def test_an_invalid_document_is_never_written(doc, tmp_path):
    target = tmp_path / "results.json"
    with pytest.raises(results.ResultsError):
        results.save(_broken(doc, lambda d: d.pop("runs")), target)
    assert list(tmp_path.iterdir()) == []


def test_load_says_what_to_do(tmp_path):
    with pytest.raises(results.ResultsError, match="cachegen bench"):
        results.load(tmp_path / "absent.json")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(results.ResultsError, match="not readable JSON"):
        results.load(garbage)


def test_mode_groups_expand_like_the_earlier_reproduction():
    modes = expand(["baseline", "cachegen"])
    labels = [m.label for m in modes]
    assert labels[:4] == ["recompute", "raw", "int8", "fp8"]
    assert "adaptive" in labels and any(label.startswith("cachegen-") for label in labels)
    assert expand(["int8", "int8", "recompute"]) == [Mode("int8"), Mode("recompute")]
    assert Mode.parse("cachegen-2") == Mode("cachegen", 2)
    with pytest.raises(InputError, match="unknown mode"):
        expand(["cachegen-x"])


def _shipped(model: str) -> dict:
    """The calibrated levels document shipped for ``model``: its cachegen default level, and
    its tcq default level with the perplexity target it was calibrated for."""
    from cachegen.codec.cachegen.profile import SHIPPED_DIR

    return json.loads((SHIPPED_DIR / f"{model}.json").read_text())


def test_adaptive_fastest_is_a_mode_of_its_own_that_asks_for_adaptive():
    mode = Mode.parse("adaptive-fastest")
    assert mode == Mode("adaptive-fastest") and mode.label == "adaptive-fastest"
    assert (mode.connector_mode, mode.codec_name, mode.form, mode.moves_kv) == (
        "adaptive",
        None,
        None,
        True,
    )
    assert Mode("adaptive").connector_mode == "adaptive" and Mode("tcq", 24).connector_mode == "tcq"
    with pytest.raises(InputError, match="unknown form"):
        Form.parse("adaptive-fastest")


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_the_tcq_group_is_each_models_default_level_and_adaptive_fastest(model):
    shipped = _shipped(model)
    level = shipped["tcq"]["default_level"]
    assert expand(["tcq"], model) == [Mode("tcq", level), Mode("adaptive-fastest")]
    assert tcq_default(model) == TcqDefault(level, shipped["tcq"]["targets"][str(level)])
    # the cachegen group takes this model's default level, not another model's
    cachegen = [m.level for m in expand(["cachegen"], model) if m.mode == "cachegen"]
    assert cachegen == sorted({1, 2, 3, shipped["default_level"]})


def test_a_model_without_a_shipped_tcq_default_has_no_tcq_modes():
    assert tcq_default("tiny-llama") is None
    assert expand(["tcq"], "tiny-llama") == [] and expand(["tcq"]) == []
    assert Mode("adaptive-fastest") not in expand(["all"], "tiny-llama")


def test_the_default_profile_measures_each_models_defaults_and_makes_room(monkeypatch):
    from cachegen.models import EMBEDDED
    from cachegen_lab.bench.sweep import DEFAULT_MODELS_ENV, _cells, profile

    monkeypatch.delenv(DEFAULT_MODELS_ENV, raising=False)
    cfg = profile("default")
    small, large = cfg.context_tokens
    for model in EMBEDDED:
        shipped = _shipped(model)
        tcq = Mode("tcq", shipped["tcq"]["default_level"])
        modes = cfg.modes_of(model)
        assert {tcq, Mode("adaptive-fastest"), Mode("cachegen", shipped["default_level"])} <= set(
            modes
        )
        assert Mode("fp8") not in modes  # left out to make room
        others = {_shipped(m)["default_level"] for m in EMBEDDED} - {shipped["default_level"]}
        assert not {Mode("cachegen", level) for level in others} & set(modes)
        assert cfg.max_loss_pct[model] == shipped["tcq"]["targets"][str(tcq.level)]
        # raw and the paper's levels at the largest context only; the defaults at both
        assert set(cfg.modes_at(model, large)) == set(modes)
        assert set(modes) - set(cfg.modes_at(model, small)) == {
            Mode("raw"),
            *(Mode("cachegen", level) for level in (1, 2, 3)),
            Mode("lmcache-cachegen"),
        }
        # LMCache's CacheGen at two links only
        assert cfg.links_of(Mode("lmcache-cachegen")) == [100.0, 1000.0]
        assert cfg.stream_links_of(Mode("lmcache-cachegen")) == [100.0, 1000.0]
        # e2e: recompute at both contexts, 9 KV modes at every link and the peer at two at the
        # largest, 5 at the other; stream: the 8 and 3 codec modes of those; quality: one step
        e2e = cfg.repeats * (2 + len(cfg.bandwidth_mbps) * (9 + 5) + 2)
        assert _cells(cfg, model) == e2e + 8 + 3 + 1
    written = cfg.to_json()
    assert written["model_modes"]["smollm2-135m"] == [m.label for m in cfg.modes_of("smollm2-135m")]
    assert written["largest_context_modes"] == [
        *("raw", "cachegen-1", "cachegen-2", "cachegen-3"),
        "lmcache-cachegen",
    ]
    assert written["mode_bandwidth_mbps"] == {"lmcache-cachegen": [100.0, 1000.0]}
    assert profile("default", bandwidth_mbps=[200.0]).mode_bandwidth_mbps == {}
    assert profile("default", context_tokens=[512, 1024]).largest_context_modes == []
    assert profile("default", modes=["all"]).largest_context_modes == []


def test_a_version_2_document_still_reads(doc, tmp_path):
    assert doc["version"] == 2  # the tiny-llama fixture predates tcq's modes
    path = results.save(doc, tmp_path / "v2.json")
    assert results.load(path)["version"] == 2


def test_the_synthetic_document_follows_the_schema_and_only_runs_are_adaptive_fastest():
    from tests.lab.bench.synthetic_results import document

    synthetic = document()
    assert synthetic["version"] == results.SCHEMA_VERSION == 4
    assert {"tcq", "adaptive-fastest"} <= {r["mode"] for r in synthetic["runs"]}
    bad = _broken(synthetic, lambda d: d["quality"][0].update(mode="adaptive-fastest", level=None))
    with pytest.raises(results.ResultsError, match="quality/0/mode"):
        results.validate(bad)


def test_default_profile_sweeps_every_embedded_model_and_quick_the_default_one(monkeypatch):
    from cachegen.models import EMBEDDED, EMBEDDED_DEFAULT
    from cachegen_lab.bench.sweep import DEFAULT_MODELS_ENV, profile

    monkeypatch.delenv(DEFAULT_MODELS_ENV, raising=False)
    assert profile("default", modes=["raw"]).models == list(EMBEDDED)
    assert "gemma3-270m" in EMBEDDED
    assert profile("quick", modes=["raw"]).models == [EMBEDDED_DEFAULT]
    monkeypatch.setenv(DEFAULT_MODELS_ENV, f"tiny-llama, {EMBEDDED_DEFAULT}")
    assert profile("quick", modes=["raw"]).models == [EMBEDDED_DEFAULT, "tiny-llama"]
    assert profile("default", modes=["raw"]).models == [*EMBEDDED, "tiny-llama"]
