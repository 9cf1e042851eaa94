"""`cachegen stream-bench` end to end with a tiny model and a real codec (small and fast)."""

from __future__ import annotations

import json

import pytest

from cachegen.cli import main
from cachegen_lab import rows
from tests.support import FIXTURES


def _stream_bench(url: str, tokens: int, chunk_tokens: int, bandwidth: str, *options: str):
    """The arguments of `cachegen stream-bench` of tiny-llama's first ``tokens`` tokens over
    links of ``bandwidth`` Mbit/s, stored at ``url``."""
    head = ["stream-bench", "--store", url, "--model", "tiny-llama", "--tokens", str(tokens)]
    return head + ["--chunk-tokens", str(chunk_tokens), "--bandwidth-mbps", bandwidth, *options]


def test_stream_bench_json(tmp_path, capsys, tiny_llama):
    url = (tmp_path / "store").as_uri()
    argv = _stream_bench(url, 512, 128, "200,1000", "--codec", "int8", "--level", "0", "--json")
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["schema"], out["version"]) == ("cachegen-stream-bench", 1)
    assert out["prepared"]["encoded_now"] and out["prepared"]["chunks"] == 4
    runs = out["runs"]
    rows.validate(runs, "stream", "stream-bench runs")
    assert [r["bandwidth_mbps"] for r in runs] == [200, 1000]
    for r in runs:
        for field in (
            "goodput_mbps",
            "bytes",
            "transfer_s",
            "decode_s",
            "load_s",
            "levels",
            "wait_bytes_s",
        ):
            assert field in r
        assert r["levels"] == ["int8"] * 4 and r["n_loaded"] == 4 and r["bytes"] == runs[0]["bytes"]
    from cachegen import models
    from cachegen.modes import Form
    from cachegen.store import open_store
    from cachegen_lab.bench.stream_bench import bench_tokens, prepare

    assert list(out["prepared"]["encode_s"]) == ["int8"]
    ids = bench_tokens(models.resolve("tiny-llama"), 512)
    again = prepare(open_store(url), "tiny-llama", "int8", ids, 128, [0], log=lambda msg: None)
    assert not again.encoded_now and not again.encode_s  # a second run reuses the stored chunks
    assert sum(again.sizes[Form("int8")]) == runs[0]["bytes"]


def test_stream_bench_adaptive_and_errors(tmp_path, capsys, tiny_llama):
    url = (tmp_path / "store").as_uri()
    argv = _stream_bench(url, 256, 128, "500", "--codec", "int8", "--slo-ms", "60000")
    argv += ["--prefill-tps", "1000", "--json"]
    assert main(argv) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["levels"] == ["int8", "int8"] and len(run["decisions"]) == 2
    assert main(argv[:-1] + ["--shaper", "carrier-pigeon"]) == 1
    assert "unknown shaper" in capsys.readouterr().err


def test_stream_bench_forms(tmp_path, capsys, tiny_llama):
    """Each form loaded alone and the adaptive choice among the allowed ones, side by side."""
    argv = _stream_bench((tmp_path / "store").as_uri(), 256, 64, "200,5000")
    argv += ["--forms", "cachegen-2,cachegen-2-packed,int8,fp8,raw", "--prefill-tps", "1000"]
    assert main(argv) == 1  # tiny-llama has no calibrated levels: the bound must be given
    assert "give --max-loss-pct" in capsys.readouterr().err
    argv += ["--loss-pct", "cachegen-2=1,int8=0.5", "--max-loss-pct", "1", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert (out["schema"], out["version"]) == ("cachegen-stream-forms-bench", 2)
    losses = {f["name"]: (f["loss_pct"], f["allowed"]) for f in out["forms"]}
    assert losses == {
        "cachegen-2": (1.0, True),
        "cachegen-2-packed": (1.0, True),  # the coded level's loss
        "int8": (0.5, True),
        "fp8": (None, False),  # no data for this model and none given: never allowed
        "raw": (0.0, True),
    }
    assert [c["bandwidth_mbps"] for c in out["columns"]] == [200, 5000]
    for column in out["columns"]:
        assert set(column["load_s"]) == set(losses)
        assert column["best_allowed"] != "fp8"
        assert column["adaptive_vs_best"] == pytest.approx(
            column["adaptive_s"] / column["best_allowed_s"]
        )
        (run,) = column["adaptive_runs"]
        assert len(run["choices"]) == 4 and "fp8" not in run["choices"]
        assert run["predicted_s"] > 0 and len(run["decisions"]) == 4
    assert "adaptive / best allowed" in captured.err and "fp8 *" in captured.err
    assert main([*argv[:-1], "--forms", "cachegen-2-coded"]) == 1
    assert "unknown form 'cachegen-2-coded'" in capsys.readouterr().err


def test_sweep_results_with_fast_and_unlimited_links_plot_and_report(tmp_path, capsys):
    """Stream runs at 5,000 and 20,000 Mbit/s and over the unlimited link (bandwidth null) pass
    the schema, and the figures, the summary and the report name the link `unlimited`."""
    import copy

    from cachegen_lab.bench import reproduction, results, summary
    from cachegen_lab.bench.sweep import profile

    fixture = FIXTURES / "bench_results.json"
    doc = json.loads(fixture.read_text())
    stream = [r for r in doc["runs"] if r["kind"] == "stream"]
    for bandwidth in (5000.0, 20000.0, None):
        for run in stream:
            doc["runs"].append({**copy.deepcopy(run), "bandwidth_mbps": bandwidth})
    links = profile("default", modes=["raw"]).stream_links
    assert links[-3:] == [5000.0, 20000.0, None]
    doc["config"]["stream_bandwidth_mbps"] = links
    doc["medians"] = results.medians(doc["runs"])
    path = results.save(doc, tmp_path / "results.json")
    assert main(["plot", str(path), "--out", str(tmp_path / "png")]) == 0
    capsys.readouterr()
    summary.print_summary(results.load(path))
    printed = capsys.readouterr().out
    assert "unlimited" in printed and "20000" in printed
    assert "| unlimited |" in reproduction.render(results.load(path), str(path))
    doc["config"]["stream_bandwidth_mbps"] = [0]
    with pytest.raises(results.ResultsError, match="stream_bandwidth_mbps"):
        results.validate(doc)


def test_custom_rates_replace_the_default_stream_links():
    from cachegen_lab.bench.sweep import profile

    assert profile("default", bandwidth_mbps=[50.0]).stream_links == [50.0]
    assert profile("quick").stream_links == profile("quick").bandwidth_mbps


def test_ttft_table_has_an_unlimited_column_after_the_rates():
    from cachegen_lab.bench.ttft import markdown

    def row(mode, bandwidth, ttft_s):
        fixed = {"context_tokens": 512, "prompt_tokens": 530, "repeats": 1, "level": None}
        return {**fixed, "shaper": "token-bucket", "mode": mode, "bandwidth_mbps": bandwidth,
                "ttft_s": ttft_s, "bytes": 1e6, "levels": [0]}  # fmt: skip

    rows = [row("recompute", None, 1.0)]
    rows += [row("int8", bw, t) for bw, t in ((None, 0.1), (20000.0, 0.2), (100.0, 0.5))]
    table = markdown(rows)
    assert "| 100 Mbit/s | 20000 Mbit/s | unlimited |" in table
    assert "| recompute | - | 1.000 | 1.000 | 1.000 |" in table
    assert "| int8 | 1.00 | 0.500 (2.0x recompute) | 0.200 (5.0x recompute) | 0.100" in table
