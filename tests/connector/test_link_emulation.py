"""The connector's seam to the lab's emulated links: found through the ``cachegen.links`` entry
point, and where it is missing, ``bandwidth_mbps``/``rtt_ms`` refused naming why."""

from __future__ import annotations

import pytest

from cachegen.connector import link_emulation
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen_lab.network import open_link


@pytest.fixture
def no_lab(monkeypatch):
    """An install without the lab's entry point."""
    link_emulation._find_opener.cache_clear()
    monkeypatch.setattr(link_emulation, "entry_points", lambda **kw: [])
    yield
    link_emulation._find_opener.cache_clear()


def test_the_lab_opens_the_connectors_links():
    assert link_emulation.link_opener() is open_link


@pytest.mark.parametrize("params", [{"bandwidth_mbps": 100}, {"rtt_ms": 5}])
def test_an_emulated_link_is_refused_without_the_lab(no_lab, params):
    with pytest.raises(ConnectorError, match="entry point 'open_link' is installed"):
        RequestOptions().override(params)  # a request's options: it falls back to recompute
    with pytest.raises(ConnectorError, match="emulate a link for experiments"):
        ConnectorConfig.from_extra_config(params)  # the engine's: it does not start
    assert RequestOptions().override({"rtt_ms": 0}).bandwidth_mbps is None
