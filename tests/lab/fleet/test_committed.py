"""The fleet documents docs/fleet.md reports from: each follows the current schema, ran without
errors, and has its figures next to it."""

from __future__ import annotations

import json

import pytest

from cachegen_lab.fleet import summary
from tests.support import REPO

DOCUMENTS = sorted((REPO / "docs" / "fleet").glob("*.json"))


def test_docs_report_fleet_documents():
    assert DOCUMENTS


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.stem)
def test_a_committed_fleet_document_is_current_and_drawn(path):
    doc = json.loads(path.read_text())
    summary.validate(doc)
    assert doc["failure"] is None
    assert all(run["summary"]["errors"] == 0 for run in doc["runs"])
    figures = REPO / "docs" / "fleet" / "figures" / path.stem
    assert {p.name for p in figures.glob("*.png")} == {"fleet_ttft.png", "fleet_throughput.png"}
