"""Fixtures for the store tests."""

from __future__ import annotations

import pytest

from cachegen.store import open_store


@pytest.fixture(params=["local", "redis"])
def store(request, tmp_path):
    """A store of each backend: a local directory, and a real redis-server (flushed)."""
    if request.param == "local":
        s = open_store((tmp_path / "store").as_uri())
    else:
        s = open_store(request.getfixturevalue("redis_url"))
    yield s
    s.close()
