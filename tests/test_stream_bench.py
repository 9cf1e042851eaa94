"""`cachegen stream-bench` end to end with a tiny model and a real codec (small and fast)."""

from __future__ import annotations

import json

from cachegen.cli import main
from cachegen.lab import rows


def test_stream_bench_json(tmp_path, capsys, tiny_llama):
    url = (tmp_path / "store").as_uri()
    argv = [
        "stream-bench",
        "--store",
        url,
        "--model",
        "tiny-llama",
        "--codec",
        "int8",
        "--tokens",
        "512",
        "--chunk-tokens",
        "128",
        "--bandwidth-mbps",
        "200,1000",
        "--level",
        "0",
        "--json",
    ]
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
        assert r["levels"] == [0] * 4 and r["n_loaded"] == 4 and r["bytes"] == runs[0]["bytes"]
    from cachegen import models
    from cachegen.lab.bench.stream_bench import bench_tokens, prepare
    from cachegen.store import open_store

    assert list(out["prepared"]["encode_s"]) == ["0"]
    ids = bench_tokens(models.resolve("tiny-llama"), 512)
    again = prepare(open_store(url), "tiny-llama", "int8", ids, 128, [0], log=lambda msg: None)
    assert not again.encoded_now and not again.encode_s  # a second run reuses the stored chunks
    assert sum(again.sizes[0]) == runs[0]["bytes"]


def test_stream_bench_adaptive_and_errors(tmp_path, capsys, tiny_llama):
    url = (tmp_path / "store").as_uri()
    argv = [
        "stream-bench",
        "--store",
        url,
        "--model",
        "tiny-llama",
        "--codec",
        "int8",
        "--tokens",
        "256",
        "--chunk-tokens",
        "128",
        "--bandwidth-mbps",
        "500",
        "--slo-ms",
        "60000",
        "--prefill-tps",
        "1000",
        "--json",
    ]
    assert main(argv) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["levels"] == [0, 0] and len(run["decisions"]) == 2
    assert main(argv[:-1] + ["--shaper", "carrier-pigeon"]) == 1
    assert "unknown shaper" in capsys.readouterr().err
