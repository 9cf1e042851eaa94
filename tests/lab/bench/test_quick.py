"""The benchmark's quick profile end to end: real vLLM (one engine), real codec, real sockets,
real quality evaluation, then results.json, figures and the report, all from the CLI.

Kept small for CI (tiny-llama, one 256-token context, one link rate, one repeat; about a
minute on 2 cores). The full profile is `make bench`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from cachegen.modes import Mode
from cachegen_lab.bench import results
from cachegen_lab.bench.plots import FIGURES
from tests.support import REPO

MODES = [
    "recompute",
    "raw",
    "int8",
    "cachegen-2",
    "adaptive",
    "cachegen-99",
    "adaptive-fastest",
    "lmcache-cachegen",
]  # tiny-llama has no level 99, and no tcq calibration that bounds adaptive-fastest
CONTEXT = 256


@pytest.fixture(scope="module")
def quick(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable,
        "-m",
        "cachegen",
        "bench",
        "--quick",
        "--models",
        "tiny-llama",
        "--modes",
        *MODES,
        "--bandwidth-mbps",
        "1000",
        "--context-tokens",
        str(CONTEXT),
        "--quality-windows",
        "1",
        "--output",
        str(out / "results.json"),
        "--plots",
        str(out / "plots"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


def test_quick_profile_writes_valid_results(quick):
    out, proc = quick
    doc = results.load(out / "results.json")  # validates against the schema
    assert doc["config"]["profile"] == "custom" and doc["config"]["repeats"] == 1
    assert doc["environment"]["versions"]["vllm"]
    assert "tiny-llama: end to end through vLLM" in proc.stdout  # the summary table


def test_every_requested_mode_is_measured_or_explained(quick):
    doc = results.load(quick[0] / "results.json")
    e2e = {(r["mode"], r["level"]) for r in doc["runs"] if r["kind"] == "e2e"}
    missing = {(m["mode"], m["level"]) for m in doc["missing"] if m["kind"] == "e2e"}
    for label in MODES:
        mode = Mode.parse(label)
        assert (mode.mode, mode.level) in e2e | missing, label
    assert all(m["reason"] for m in doc["missing"])
    (unbounded,) = {m["reason"] for m in doc["missing"] if m["mode"] == "adaptive-fastest"}
    assert "ships no tcq calibration" in unbounded


def test_a_mode_that_cannot_be_measured_is_reported_never_invented(quick):
    doc = results.load(quick[0] / "results.json")
    assert not [r for r in doc["runs"] if r["level"] == 99]
    assert not [q for q in doc["quality"] if q["level"] == 99]
    explained = {m["kind"]: m["reason"] for m in doc["missing"] if m["level"] == 99}
    assert set(explained) == {"e2e", "stream", "quality"}
    assert all("99" in reason for reason in explained.values())


def test_recompute_and_raw_are_real_vllm_measurements(quick):
    doc = results.load(quick[0] / "results.json")
    by_mode = {r["mode"]: r for r in doc["runs"] if r["kind"] == "e2e"}
    recompute, raw = by_mode["recompute"], by_mode["raw"]
    assert recompute["ttft_s"] > 0 and recompute["e2e_s"] >= recompute["ttft_s"]
    assert recompute["output_tokens"] == doc["config"]["output_tokens"]
    assert recompute["loaded_tokens"] == 0 and recompute["bytes"] is None
    # Raw mode loaded the whole stored context through the connector, in the engines' dtype:
    # ratio 1 to 16-bit KV for bf16 engines, 0.5 for float32 ones (CPUs without bf16).
    assert raw["loaded_tokens"] == CONTEXT
    width = {"bfloat16": 2, "float32": 4}[doc["environment"]["engine_dtype"]]
    assert raw["ratio_vs_fp16"] == pytest.approx(2 / width, rel=0.05)


def test_stream_and_quality_parts_use_the_real_codec(quick):
    doc = results.load(quick[0] / "results.json")
    stream = {(r["mode"], r["level"]): r for r in doc["runs"] if r["kind"] == "stream"}
    # adaptive and recompute have no fixed size; level 99 does not exist
    assert set(stream) == {
        ("raw", None),
        ("int8", None),
        ("cachegen", 2),
        ("lmcache-cachegen", None),
    }
    assert stream[("raw", None)]["ratio_vs_fp16"] == pytest.approx(1.0, rel=0.05)
    assert stream[("int8", None)]["ratio_vs_int8"] == pytest.approx(1.0, rel=1e-6)
    assert stream[("cachegen", 2)]["ratio_vs_int8"] > 1.0
    for row in stream.values():
        assert 0 < row["transfer_s"] <= row["load_s"]  # the load ends after its last byte arrives
    quality = {(q["mode"], q["level"]): q for q in doc["quality"]}
    assert quality[("raw", None)]["ppl_change_pct"] == pytest.approx(0.0, abs=1e-6)
    assert quality[("raw", None)]["top1_agreement"] == 1.0


def test_figures_and_report_from_the_quick_results(quick, tmp_path):
    out, _ = quick
    for name in FIGURES:
        assert (out / "plots" / f"{name}.png").stat().st_size > 10_000, name
    report = tmp_path / "reproduction.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachegen",
            "report",
            str(out / "results.json"),
            "--out",
            str(report),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| paper's claim" in report.read_text()


def test_lmcache_cachegen_goes_through_vllm_into_the_results_and_the_report(quick):
    """The lab's peer, LMCache's CacheGen: stored, loaded and injected by the lab's connector,
    streamed and scored like the others, and in the report's column of its own."""
    out, _ = quick
    doc = results.load(out / "results.json")
    peer = [r for r in doc["runs"] if r["mode"] == "lmcache-cachegen"]
    e2e = [r for r in peer if r["kind"] == "e2e"]
    assert e2e and all(r["loaded_tokens"] == CONTEXT for r in e2e)
    assert [r for r in peer if r["kind"] == "stream"][0]["ratio_vs_int8"] > 1.0
    assert [q for q in doc["quality"] if q["mode"] == "lmcache-cachegen"]
    from cachegen_lab.bench import reproduction

    text = reproduction.render(doc, "results.json")
    (size,) = [row for row in text.splitlines() if row.startswith("| KV 3.5")]
    assert "| LMCache's CacheGen |" in text and "tiny-llama: " in size.split(" | ")[4]
