"""The suite's schedule (tests/conftest.py): every file named to run first exists, so a renamed
file cannot silently fall back to the end of the run."""

from __future__ import annotations

from tests.conftest import LONGEST_FIRST
from tests.support import REPO


def test_every_file_named_to_run_first_exists():
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [path for path in LONGEST_FIRST if not (REPO / path).is_file()] == []
