"""`cachegen plot` draws every figure and `cachegen report` renders the claims, from a fixture."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from cachegen.cli import main
from cachegen.lab.bench import results
from cachegen.lab.bench.plots import FIGURES, pareto
from tests.support import DOCS, FIXTURES

FIXTURE = FIXTURES / "bench_results.json"


def _check_pngs(directory: Path) -> None:
    import matplotlib.image

    for name in FIGURES:
        image = matplotlib.image.imread(directory / f"{name}.png")
        height, width = image.shape[:2]
        assert width >= 500 and height >= 300, name
        assert image[..., :3].std() > 0.01, f"{name} is blank"


def test_plot_draws_every_figure_from_the_fixture(tmp_path, capsys):
    assert main(["plot", str(FIXTURE), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / f"{name}.png") for name in FIGURES]
    _check_pngs(tmp_path)


def test_plot_copes_with_parts_that_were_not_measured(tmp_path):
    doc = json.loads(FIXTURE.read_text())
    doc["runs"] = [r for r in doc["runs"] if r["mode"] == "recompute"]
    doc["quality"] = []
    doc["missing"].append(
        {
            "kind": "quality",
            "model": doc["config"]["models"][0],
            "mode": "cachegen",
            "level": 2,
            "reason": "skipped in this test",
        }
    )
    doc["medians"] = results.medians(doc["runs"])
    path = results.save(doc, tmp_path / "partial.json")
    assert main(["plot", str(path), "--out", str(tmp_path / "png")]) == 0
    _check_pngs(tmp_path / "png")


def test_plot_rejects_a_file_that_is_not_results(tmp_path, capsys):
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"schema": "something else"}))
    assert main(["plot", str(bad), "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("cachegen plot: error:") and "\n" not in err


@pytest.mark.parametrize(
    "document", [DOCS / "streaming" / "forms-4000.json", DOCS / "connector" / "ttft-forms.json"]
)
def test_plot_draws_a_stored_forms_document(document, tmp_path, capsys):
    """The committed stream-bench --forms and ttft table documents, each as its own figure."""
    import matplotlib.image

    assert main(["plot", str(document), "--out", str(tmp_path)]) == 0
    png = tmp_path / f"{document.stem}.png"
    assert capsys.readouterr().out.split() == [str(png)]
    image = matplotlib.image.imread(png)
    assert image.shape[1] >= 500 and image.shape[0] >= 300
    assert image[..., :3].std() > 0.01, f"{png.name} is blank"


def test_plot_refuses_a_stored_forms_document_of_another_version(tmp_path, capsys):
    doc = json.loads((DOCS / "streaming" / "forms-4000.json").read_text())
    doc["version"] = 99
    path = tmp_path / "forms.json"
    path.write_text(json.dumps(doc))
    assert main(["plot", str(path), "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "version 99" in err and not (tmp_path / "forms.png").exists()


def test_report_sets_each_claim_beside_the_measurement(tmp_path):
    out = tmp_path / "reproduction.md"
    assert main(["report", str(FIXTURE), "--out", str(out)]) == 0
    text = out.read_text()
    doc = json.loads(FIXTURE.read_text())
    assert "3.5-4.3x" in text and "3.2-3.7x" in text and "negligible" in text
    assert f"cachegen report {FIXTURE}" in text  # names the command that regenerates it
    # The size claim quotes the fixture's own ratios vs int8 (largest context), not a made-up
    # number.
    stream = [r for r in doc["medians"] if r["kind"] == "stream" and r["mode"] == "cachegen"]
    largest = max(r["context_tokens"] for r in stream)
    ratios = {f"{r['ratio_vs_int8']:.2f}x" for r in stream if r["context_tokens"] == largest}
    assert ratios and all(ratio in text for ratio in ratios)
    for missing in doc["missing"]:
        assert missing["reason"].replace("|", "\\|") in text


def test_report_says_not_measured_instead_of_inventing(tmp_path):
    doc = copy.deepcopy(json.loads(FIXTURE.read_text()))
    doc["runs"] = [r for r in doc["runs"] if r["mode"] != "cachegen"]
    doc["quality"] = [q for q in doc["quality"] if q["mode"] != "cachegen"]
    doc["medians"] = results.medians(doc["runs"])
    path = results.save(doc, tmp_path / "no-cachegen.json")
    out = tmp_path / "r.md"
    assert main(["report", str(path), "--out", str(out)]) == 0
    claims = [
        line
        for line in out.read_text().splitlines()
        if line.startswith("| KV 3.5") or line.startswith("| negligible")
    ]
    assert len(claims) == 2 and all("| not measured |" in line for line in claims)


@pytest.mark.parametrize(
    "points, front",
    [
        ([(2.0, 5.0), (3.0, 1.0), (4.0, 2.0), (8.0, 0.0)], [(2.0, 5.0), (3.0, 1.0), (8.0, 0.0)]),
        ([(1.0, 1.0), (1.0, 3.0)], [(1.0, 1.0)]),
    ],
)
def test_pareto_frontier(points, front):
    assert pareto(points) == front
