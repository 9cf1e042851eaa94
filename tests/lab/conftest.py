"""Fixtures of the tcq labs' tests (ablation, calibration, redundancy)."""

from __future__ import annotations

import pytest

from tests.codec.transform_support import own_profile_dir


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """A profile directory of the module's own (tiny-llama's tcq model is fitted once into
    it)."""
    with own_profile_dir(tmp_path_factory.mktemp("profiles")) as path:
        yield path
