"""Secrets never travel in ``kv_connector_extra_config`` nor on a command line: vLLM's command
line and start-up log show that configuration, so the store secret comes from
``store_secret_file`` (or ``$CACHEGEN_STORE_SECRET``) and a Redis password from the store URL's
``password_file`` (or ``password_env``); either given inline is refused with the fix, in a
message that never holds the value (docs/security.md, "Secrets: files and the environment")."""

from __future__ import annotations

import pytest

from cachegen.connector.config import ConnectorConfig
from cachegen.connector.errors import ConnectorError
from tests.support import private_file

SECRET = "inline-secret-Wq4z-never-shown"
PASSWORD = "inline-pw-Rt8j-never-shown"


def _refusal(extra: dict) -> str:
    with pytest.raises(ConnectorError) as caught:
        ConnectorConfig.from_extra_config(extra)
    message = str(caught.value)
    assert SECRET not in message and PASSWORD not in message, message
    return message


def test_an_inline_store_secret_is_refused_with_the_fix():
    message = _refusal({"store_secret": SECRET})
    assert "store_secret_file" in message and "CACHEGEN_STORE_SECRET" in message
    assert "command line" in message and "log" in message


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{PASSWORD}@127.0.0.1:6379/0",
        f"rediss://alice:{PASSWORD}@redis.example:6380/0?ssl_ca_certs=/ca.pem",
        f"redis+cluster://127.0.0.1:7000?password={PASSWORD}",
    ],
)
def test_an_inline_store_password_is_refused_with_the_fix(url):
    message = _refusal({"store": url})
    assert "?password_file=" in message and "?password_env=" in message
    assert "command line" in message and "***" in message


def test_the_store_secret_comes_from_its_file(tmp_path):
    path = private_file(tmp_path / "secret", SECRET + "\r\n")  # trailing line breaks dropped
    config = ConnectorConfig.from_extra_config({"store_secret_file": str(path)})
    assert config.store_secret == SECRET and SECRET not in repr(config)
    assert ConnectorConfig.from_extra_config({}).store_secret is None  # then the environment's


def test_a_store_secret_file_that_cannot_serve_stops_start_up_by_name(tmp_path):
    shared = private_file(tmp_path / "shared", SECRET)
    shared.chmod(0o644)
    blank = private_file(tmp_path / "blank", "\n\n")
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe" + SECRET.encode())
    binary.chmod(0o600)
    cases = {
        shared: ("group or others", "chmod 600"),
        tmp_path / "absent": ("does not exist",),
        blank: ("is empty",),
        binary: ("not UTF-8 text",),
        tmp_path: ("not a regular file",),
    }
    for path, needles in cases.items():
        message = _refusal({"store_secret_file": str(path)})
        assert message.startswith(f"store_secret_file {str(path)!r}"), message
        for needle in needles:
            assert needle in message, message
    assert "path of a file" in _refusal({"store_secret_file": ""})


def test_the_cli_refuses_an_inline_password_in_store(capsys):
    from cachegen.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["store", "stats", "--store", f"redis://:{PASSWORD}@127.0.0.1:6379/0"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "argument --store" in err and "?password_file=" in err and PASSWORD not in err
