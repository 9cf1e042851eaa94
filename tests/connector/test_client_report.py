"""What a request's report tells its client (``client_report``): by default reason codes only,
never a store's error text (hosts, paths, keys) nor the tokens loaded; the error of the
client's own refused options; everything with ``full``; nothing with ``none``."""

from __future__ import annotations

import pytest

from cachegen.connector.client_report import for_client
from cachegen.connector.config import ConnectorConfig
from cachegen.connector.errors import ConnectorError
from cachegen.kv import ModelIdentity

REPORT = {
    "schema": "cachegen-connector-report",
    "version": 2,
    "mode": "int8",
    "loaded_tokens": 512,
    "chunks": 2,
    "forms": ["int8", "int8"],
    "load_error": "StoreUnavailable: redis at 10.0.0.7:6379 timed out reading ns/abc",
    "error": "lookup failed: store_timeout",
    "fallback": "store_timeout",
    "save_skipped": "store_timeout",
}


def test_by_default_a_client_sees_reason_codes_only():
    seen = for_client(REPORT, ConnectorConfig().client_report)
    assert seen == {
        "schema": "cachegen-connector-report",
        "version": 2,
        "mode": "int8",
        "fallback": "store_timeout",
        "save_skipped": "store_timeout",
    }


def test_a_client_sees_why_its_own_options_were_refused():
    refused = {**REPORT, "fallback": "bad_options", "error": "level must be an integer"}
    assert for_client(refused, "reasons")["error"] == "level must be an integer"


def test_full_shows_the_whole_report_and_none_shows_nothing():
    assert for_client(REPORT, "full") == REPORT
    assert for_client(REPORT, "none") is None


def test_another_setting_is_refused_at_start_up():
    model = ModelIdentity("m", "f", 2, 1, 64)
    with pytest.raises(ConnectorError, match="client_report"):
        ConnectorConfig.from_extra_config({"client_report": "everything"}, model)
