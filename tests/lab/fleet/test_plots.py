"""`cachegen plot` on a fleet-bench document: a small document of the current version, built by
hand (three runs: prefix-cache, raw at 100 Mbit/s, raw unlimited with a failover and an
error) becomes fleet_ttft.png and fleet_throughput.png, and so does one that ended early (a
configuration failed); a document of another schema, an older version or one that does not
follow the schema is refused with a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachegen.cli import main
from cachegen_lab.fleet import summary
from tests.lab.fleet.document_support import SETTINGS, setup

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(config: str, rate: float | None, index: int, ttft: float, **changes) -> dict:
    return {
        "config": config,
        "bandwidth_mbps": rate,
        "workload": "multi-round-qa",
        "index": index,
        "key": f"user-{index % 2}",
        "round": index // 2,
        "routed": index % 2,
        "server": index % 2,
        "attempts": [],
        "send_s": 0.1 * index,
        "ttft_s": ttft,
        "end_s": 0.1 * index + ttft + 0.05,
        "prompt_tokens": 600,
        "cached_tokens": 256 * (index // 2),
        "output_tokens": 4,
        "report": {"loaded_tokens": 256} if config != "prefix-cache" else None,
        "error": None,
        "answer": "an answer",
        **changes,
    }


def _run(config: str, rate: float | None, records: list[dict]) -> dict:
    connector = config != "prefix-cache"
    return {
        "config": config,
        "bandwidth_mbps": rate,
        "setup": setup(config, connector),
        "summary": summary.summarize(records, 2, connector=connector),
        "stops": [],
        "records": records,
        "store": _census(len(records)) if connector else None,
    }


def _census(entries: int) -> dict:
    tally = {"entries": entries, "payload_bytes": 1000 * entries}
    return {
        "chunks": entries,
        **tally,
        "kinds": {"full": tally},
        "forms": {"raw": tally},
        "unreadable": 0,
    }


def _document(failure: dict | None = None) -> dict:
    failed = {"attempts": [{"server": 1, "error": "APIConnectionError()"}], "server": 0}
    runs = [
        _run("prefix-cache", None, [_record("prefix-cache", None, i, 0.2) for i in range(4)]),
        _run("raw", 100.0, [_record("raw", 100.0, i, 0.1 + 0.01 * i) for i in range(4)]),
        _run(
            "raw",
            None,
            [
                _record("raw", None, 0, 0.05),
                _record("raw", None, 1, 0.06, **failed),
                _record("raw", None, 2, 0.07),
                _record("raw", None, 3, 0.3, ttft_s=None, error="ReadTimeout()", answer=""),
            ],
        ),
    ]
    doc = summary.document(SETTINGS, runs, failure)
    summary.validate(doc)
    return doc


def _write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    "failure",
    [None, {"config": "int8", "error": "int8 at 100: the warm-up request on server 1 failed"}],
    ids=["every configuration ran", "ended early"],
)
def test_plot_draws_the_ttft_and_throughput_of_every_run(failure, tmp_path, capsys):
    path = _write(tmp_path / "fleet.json", _document(failure))
    out = tmp_path / "png"
    assert main(["plot", str(path), "--out", str(out)]) == 0
    pngs = [out / "fleet_ttft.png", out / "fleet_throughput.png"]
    assert capsys.readouterr().out.split() == [str(p) for p in pngs]
    for png in pngs:
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, png.name


def _broken_record(doc: dict) -> dict:
    del doc["runs"][0]["records"][0]["server"]
    return doc


def _without_failure(doc: dict) -> dict:
    del doc["failure"]
    return doc


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda d: {**d, "schema": "cachegen-fleet-bench-x"}, "cachegen-fleet-bench-x"),
        (lambda d: {**d, "version": 2}, "version 2"),
        (_broken_record, "'server' is a required property"),
        (_without_failure, "'failure' is a required property"),
    ],
    ids=["unknown schema", "older version", "record without its server", "no failure field"],
)
def test_plot_refuses_a_document_it_cannot_draw(change, says, tmp_path, capsys):
    path = _write(tmp_path / "fleet.json", change(_document()))
    assert main(["plot", str(path), "--out", str(tmp_path / "png")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("cachegen plot: error:") and "\n" not in err
    assert says in err and str(path) in err
    assert not (tmp_path / "png").exists()
