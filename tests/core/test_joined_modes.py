"""Codecs of one form joined to the vocabulary (cachegen.modes.join_codec): modes and forms of
the process that joins them, for the connector's options too; names the vocabulary already
reads are refused."""

from __future__ import annotations

import pytest

from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.errors import InputError
from cachegen.modes import (
    CONNECTOR_MODES,
    MODES,
    Form,
    Mode,
    all_modes,
    connector_modes,
    join_codec,
)

JOINED = "int8-zstd"  # a lab codec of one form (cachegen.codecs entry point)


@pytest.fixture
def joined(monkeypatch):
    from cachegen import modes

    monkeypatch.setattr(modes, "_JOINED", dict(modes._JOINED))
    join_codec(JOINED)
    join_codec(JOINED)  # again: harmless
    return JOINED


def test_a_joined_codec_is_a_mode_and_a_form(joined):
    assert Mode.parse(joined) == Mode(joined) and Mode(joined).form == Form(joined)
    assert Form.parse(joined) == Form(joined) and Form(joined).label == joined
    assert all_modes()[: len(MODES)] == MODES and all_modes().count(joined) == 1
    assert connector_modes()[: len(CONNECTOR_MODES)] == CONNECTOR_MODES
    with pytest.raises(InputError, match="unknown form"):
        Form.parse(f"{joined}-packed")


def test_the_connector_serves_a_joined_codec_only_where_it_was_joined(joined, monkeypatch):
    config = ConnectorConfig.from_extra_config({"save_modes": ["raw", joined], "mode": "raw"})
    assert config.modes == ("raw", joined, "adaptive")
    assert config.request_options({"mode": joined}).mode == joined
    from cachegen import modes

    monkeypatch.setattr(modes, "_JOINED", {})
    with pytest.raises(ConnectorError, match=f"unknown mode {joined!r}"):
        RequestOptions(mode=joined)
    with pytest.raises(InputError, match="unknown mode"):
        Mode.parse(joined)


@pytest.mark.parametrize("name", ["", "raw", "adaptive-fastest", "cachegen-x", "tcq-2", "x-packed"])
def test_a_name_the_vocabulary_reads_cannot_join(name):
    with pytest.raises(InputError, match="cannot join"):
        join_codec(name)
