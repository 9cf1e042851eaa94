"""The lab's rows and JSON documents: one row schema, and readers that refuse unknown versions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cachegen.errors import InputError
from cachegen_lab import rows
from cachegen_lab.bench import results
from cachegen_lab.bench.engine_process import EngineError, check_ready
from cachegen_lab.quality import report
from cachegen_lab.rows import LoadRow, RequestRow, Run, StreamRow, TTFTRow
from tests.support import DOCS, FIXTURES

FIXTURE = FIXTURES / "bench_results.json"
REPORT = {
    "loaded_tokens": 512,
    "bytes": 9000,
    "forms": ["cachegen-2", "cachegen-2"],
    "transfer_s": 0.1,
    "decode_s": 0.05,
    "inject_s": 0.01,
    "load_s": 0.12,
    "goodput_mbps": 720.0,
}


def _measurement(mode="cachegen", level=2, connector=REPORT) -> SimpleNamespace:
    """What ``ConnectorEngine.run`` returns, without starting vLLM."""
    return SimpleNamespace(
        mode=mode,
        level=level,
        bandwidth_mbps=100.0,
        slo_ms=None,
        prompt_tokens=530,
        ttft_s=0.3,
        ttft_wall_s=0.31,
        e2e_s=0.9,
        output_tokens=16,
        output_tokens_per_s=25.0,
        cached_tokens=512,
        token_ids=list(range(16)),
        connector=dict(connector),
    )


def test_every_dataclass_field_is_a_field_of_the_schema():
    known = set(rows.schema()["$defs"]["fields"]["properties"])
    for cls in (LoadRow, RequestRow, TTFTRow, Run, StreamRow):
        assert {f.name for f in dataclasses.fields(cls)} <= known, cls.__name__


def test_a_measurement_makes_one_row_for_the_sweep_and_the_ttft_table():
    request = RequestRow.from_measurement(_measurement(), "m")
    assert (request.mode, request.level, request.loaded_tokens, request.inject_s) == (
        "cachegen",
        2,
        512,
        0.01,
    )
    run = Run.of(request, kind="e2e", context_tokens=512, repeat=0)
    ttft = TTFTRow(**{**request.to_dict(), "context_tokens": 512}, repeats=1, ttft_runs_s=[0.3])
    rows.validate([run.to_dict()], "run", "runs")
    rows.validate([ttft.to_dict()], "ttft", "ttft")
    assert request.levels == ["cachegen-2", "cachegen-2"]  # the report's forms, by name
    packed = RequestRow.from_measurement(_measurement(level="cachegen-2-packed"), "m")
    packed_ttft = {**packed.to_dict(), "context_tokens": 512, "repeats": 1, "ttft_runs_s": [0.3]}
    rows.validate([packed_ttft], "ttft", "ttft")  # a packed form, by its name
    with pytest.raises(InputError, match="level"):
        rows.validate([{**packed_ttft, "level": "cachegen-2-zipped"}], "ttft", "ttft")
    assert list(run.to_dict())[:4] == ["kind", "model", "mode", "level"]
    recompute = RequestRow.from_measurement(_measurement("recompute", None, {}), "m")
    assert recompute.loaded_tokens == 0 and recompute.bytes is None
    refused = RequestRow.from_measurement(_measurement(connector={"error": "bad mode"}), "m")
    assert refused.loaded_tokens is None and refused.load_error == "bad mode"


def test_a_stream_row_is_a_stream_row_and_a_run():
    row = StreamRow(
        model="m", codec="int8", level=0, shaper="token-bucket", bandwidth_mbps=100.0,
        context_tokens=512, loaded_tokens=512, bytes=600_000, levels=["int8", "int8"],
        transfer_s=0.05, decode_s=0.01, load_s=0.06, goodput_mbps=96.0,
        n_chunks=2, n_loaded=2, consume_s=0.001, wait_bytes_s=0.04, wait_decoder_s=0.0,
    )  # fmt: skip
    rows.validate([row.to_dict()], "stream", "stream-bench runs")
    run = Run.of(row, kind="stream", mode="int8", level=None, repeat=0, ratio_vs_fp16=1.9)
    rows.validate([run.to_dict()], "run", "runs")


def test_a_row_that_breaks_the_schema_is_named():
    bad = dict(json.loads(FIXTURE.read_text())["runs"][3], tokens_per_s=3.0)  # an old name
    with pytest.raises(InputError, match=r"results.json: row 1 .*tokens_per_s"):
        rows.validate([json.loads(FIXTURE.read_text())["runs"][0], bad], "run", "results.json")


def test_committed_rows_follow_the_row_schema():
    results = 0
    for path in sorted(DOCS.glob("quality/*/**/*.json")):  # result folders, nested ones too
        schema = json.loads(path.read_text())["schema"]
        # calibrations, the packed-form selection's candidates and rankings (docs/quality.md)
        # and the tcq ablation, redundancy, prediction, layers and calibration (docs/codec.md)
        # have rows of their own kinds
        if schema in (
            "cachegen-calibration",
            "cachegen-tcq-calibration",
            "cachegen-packed-candidates",
            "cachegen-packed-fit",
            "cachegen-tcq-ablation",
            "cachegen-tcq-redundancy",
            "cachegen-tcq-prediction",
            "cachegen-tcq-layers",
        ):
            continue
        assert report.read_document(path)["rows"]
        results += 1
    assert results >= 10
    for name, schema, kind in (
        ("ttft", "table", "ttft"),
        ("ttft-forms", "table", "ttft"),
        ("timeline", "timeline", "timeline"),
    ):
        path = DOCS / "connector" / f"{name}.json"
        doc = json.loads(path.read_text())
        assert (doc["schema"], doc["version"]) == (f"cachegen-ttft-{schema}", 1)
        rows.validate(doc["rows"], kind, str(path))


def _with_version(path: Path, source: Path, version: int) -> Path:
    doc = json.loads(source.read_text())
    doc["version"] = version
    path.write_text(json.dumps(doc))
    return path


def test_results_refuse_an_unknown_version_naming_the_file(tmp_path):
    path = _with_version(tmp_path / "results.json", FIXTURE, 1)
    with pytest.raises(InputError, match=f"{path} is 'cachegen-bench-results' version 1"):
        results.load(path)


def test_quality_results_refuse_an_unknown_version_naming_the_file(tmp_path):
    source = DOCS / "quality" / "smollm2-level6" / "eval.json"
    path = _with_version(tmp_path / "eval.json", source, 99)
    with pytest.raises(InputError, match=f"{path} is 'cachegen-quality-results' version 99"):
        report.read_document(path)


def test_calibration_refuses_an_unknown_version_naming_the_file(tmp_path):
    from cachegen_lab.quality.calibrate import load_choices

    source = DOCS / "quality" / "smollm2" / "calibration-prerope.json"
    path = _with_version(tmp_path / "calibration.json", source, 99)
    with pytest.raises(InputError, match=f"{path} is 'cachegen-calibration' version 99"):
        load_choices(path, "tiny-llama")


def test_the_engine_protocol_is_checked():
    ready = {"schema": "cachegen-engine-protocol", "version": 2, "event": "ready"}
    assert check_ready(ready) == ready
    with pytest.raises(EngineError, match="ready event is 'cachegen-engine-protocol' version 1"):
        check_ready({**ready, "version": 1})  # its run requests carry no max_loss_pct
    with pytest.raises(EngineError, match='ready event has no "schema"'):
        check_ready({"event": "ready"})
