"""The chunk store defends itself: signed records, Redis credentials and TLS, a record size cap.

Redis tests start their own redis-server processes on free loopback ports (password, ACL
user, TLS with a throwaway CA made by the openssl CLI).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import subprocess
from pathlib import Path

import pytest

from cachegen.store import (
    ChunkCorrupt,
    ChunkForged,
    ChunkTooLarge,
    RecordAddress,
    StoreConfigError,
    StoreError,
    StoreUnavailable,
    open_store,
    record,
)
from cachegen.store.local import LocalStore
from tests.support import configured_redis, free_port, private_file, require_tool

SECRET = "s3cret-Zq8v-do-not-print"
OTHER_SECRET = b"another-secret-entirely"
KEY, OTHER_KEY = "ns/chunk0", "ns/chunk1"
PASSWORD = "pw-Hx91-never-shown"


# ---- helpers -------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(directory: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, a server certificate it signed for 127.0.0.1, and an unrelated second CA."""
    require_tool("openssl")
    d = tmp_path_factory.mktemp("certs")
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    (d / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "server.ext", cwd=d,
    )  # fmt: skip
    return d


def _overwrite(store, key: str, level: int, data: bytes) -> None:
    """What any writer with access to the backend (but not the secret) can do."""
    if isinstance(store, LocalStore):
        path = store.root / "chunks" / key / f"L{level}.cgc"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    else:
        store._r.set(store._name(key, level), data)


def _forge(rec: bytes, payload: bytes, key: str | None = None, level: int | None = None) -> bytes:
    """``rec`` with another payload (and optionally key / level), length and SHA-256 fixed up:
    consistent for any reader that does not know the secret."""
    size = record.header_size(rec[4])
    head = bytearray(rec[:size])
    struct.pack_into("<Q", head, 8, len(payload))
    head[16:48] = hashlib.sha256(payload).digest()
    if key is not None:
        head[48:64] = record.key_digest(key)
    if level is not None:
        struct.pack_into("<H", head, 6, level)
    return bytes(head) + payload


@pytest.fixture(params=["local", "redis"])
def location(request, tmp_path) -> str:
    """A URL of an empty store; every test opens it with and without the secret."""
    if request.param == "local":
        return (tmp_path / "store").as_uri()
    return request.getfixturevalue("redis_url")  # tests/conftest.py fails without redis-server


@pytest.fixture(autouse=True)
def _no_secret_in_environment(monkeypatch):
    monkeypatch.delenv(record.SECRET_ENV, raising=False)


# ---- signed records ------------------------------------------------------------------------


def test_signed_round_trip(location):
    blobs = {(k, lv): bytes([lv]) * (3000 + lv) for k in (KEY, OTHER_KEY) for lv in (0, 2)}
    with open_store(location, secret=SECRET) as signed:
        assert signed.signed
        for (k, lv), blob in blobs.items():
            signed.put(k, lv, blob)
        for (k, lv), blob in blobs.items():
            assert signed.get(k, lv) == blob
            assert b"".join(signed.get_stream(k, lv, block_size=1000)) == blob
        rec = signed.get_record(KEY, 2)
        assert rec[4] == record.VERSION_SIGNED and len(rec) == 96 + len(blobs[(KEY, 2)])
        assert signed.sizes([KEY, OTHER_KEY], 0) == [3000, 3000]
        assert sorted(e.size for e in signed.list()) == [3000, 3000, 3002, 3002]
    with open_store(location) as plain:  # no secret: readable, the MAC is not checked
        assert not plain.signed
        assert plain.get(KEY, 2) == blobs[(KEY, 2)]
        assert b"".join(plain.get_stream(KEY, 0, block_size=700)) == blobs[(KEY, 0)]
        assert plain.sizes([KEY], 2) == [3002]


def test_unsigned_store_writes_version_1_bytes(location):
    payload = b"payload bytes" * 10
    with open_store(location) as plain:
        plain.put(KEY, 3, payload)
        expected = struct.pack(
            "<4sBBHQ32s16s", b"CGCK", 1, 0, 3, len(payload),
            hashlib.sha256(payload).digest(), hashlib.sha256(KEY.encode()).digest()[:16],
        ) + payload  # fmt: skip
        assert plain.get_record(KEY, 3) == expected


def test_forged_record_is_refused(location):
    with open_store(location, secret=SECRET) as signed, open_store(location) as plain:
        signed.put(KEY, 1, b"genuine" * 500)
        forged = _forge(signed.get_record(KEY, 1), b"attacker" * 400)
        _overwrite(plain, KEY, 1, forged)
        assert plain.get(KEY, 1) == b"attacker" * 400  # consistent for a reader without secret
        with pytest.raises(ChunkForged) as caught:
            signed.get(KEY, 1)
        message = str(caught.value)
        assert "not written with this store's secret" in message and "altered" in message
        assert "recomput" in message and "same secret" in message
        with pytest.raises(ChunkForged):
            list(signed.get_stream(KEY, 1, block_size=512))
        assert isinstance(caught.value, ChunkCorrupt)  # callers already recompute on it


def test_record_copied_under_another_key_or_level_is_refused(location):
    with open_store(location, secret=SECRET) as signed:
        signed.put(KEY, 1, b"chunk zero")
        genuine = signed.get_record(KEY, 1)
        for key, level in ((OTHER_KEY, 1), (KEY, 2)):
            _overwrite(signed, key, level, genuine)  # copied as is
            with pytest.raises(ChunkForged, match="another key or level"):
                signed.get(key, level)
            # the header rewritten for the new place too: only the MAC can tell
            _overwrite(signed, key, level, _forge(genuine, b"chunk zero", key, level))
            with pytest.raises(ChunkForged, match="signature"):
                signed.get(key, level)
            with pytest.raises(ChunkForged):
                list(signed.get_stream(key, level))


def test_unsigned_record_and_wrong_secret_are_refused(location):
    with open_store(location) as plain:
        plain.put(KEY, 0, b"written without a secret")
    with open_store(location, secret=SECRET) as signed:
        with pytest.raises(ChunkForged, match="unsigned"):
            signed.get(KEY, 0)
        with pytest.raises(ChunkForged):
            list(signed.get_stream(KEY, 0))
    with open_store(location, secret=OTHER_SECRET) as other:
        other.put(KEY, 0, b"written with another secret")
    with open_store(location, secret=SECRET) as signed:
        with pytest.raises(ChunkForged, match="signature"):
            signed.get(KEY, 0)


def test_secret_is_never_shown(location, monkeypatch):
    messages = []
    with open_store(location, secret=SECRET, max_record_bytes=4096) as signed:
        for text in (repr(signed), str(signed), repr(vars(signed)), str(signed.stats())):
            assert SECRET not in text
        assert repr(signed.record_signer) == "Signer(secret=<hidden>)"
        with pytest.raises(TypeError):
            pickle.dumps(signed.record_signer)
        signed.put(KEY, 0, b"x")
        _overwrite(signed, KEY, 0, _forge(signed.get_record(KEY, 0), b"y"))
        for op in (
            lambda: signed.get(KEY, 0),
            lambda: signed.put(KEY, 1, b"z" * 5000),
            lambda: open_store(location + "?secret=" + SECRET),
            lambda: open_store(location, secret=12345),
        ):
            with pytest.raises(StoreError) as caught:
                op()
            messages.append(str(caught.value))
    assert len(messages) == 4 and not any(SECRET in m for m in messages)
    assert "cannot be given in the store URL" in messages[2]
    # the environment variable, when no secret is passed; empty means none
    monkeypatch.setenv(record.SECRET_ENV, SECRET)
    assert open_store(location).signed
    assert not open_store(location, secret="").signed
    monkeypatch.setenv(record.SECRET_ENV, "")
    assert not open_store(location).signed


def test_chunk_server_path_verifies(tmp_path):
    """Records forwarded by a ChunkServer are verified by the SocketSource with the secret."""
    from cachegen_lab.network import ChunkServer, SocketSource

    url = (tmp_path / "s").as_uri()
    with open_store(url, secret=SECRET) as signed, open_store(url) as plain:
        signed.put(KEY, 0, b"genuine")
        plain.put(OTHER_KEY, 0, b"unsigned")
        with ChunkServer(plain) as server:  # the server itself needs no secret
            for secret, ok in ((signed.record_signer, [KEY]), (SECRET, [KEY]), (None, [])):
                conn = SocketSource(server.address, secret=secret).open()
                try:
                    conn.request(RecordAddress.of(KEY, "raw"))
                    conn.request(RecordAddress.of(OTHER_KEY, "raw"))
                    assert conn.receive().payload == b"genuine"
                    if ok:
                        with pytest.raises(ChunkForged):
                            conn.receive()
                    else:
                        assert conn.receive().payload == b"unsigned"
                finally:
                    conn.close()


# ---- redis authentication and TLS ----------------------------------------------------------


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory):
    require_tool("redis-server")
    with configured_redis(
        tmp_path_factory.mktemp("auth"),
        f"requirepass {PASSWORD}",
        f"user alice on >{PASSWORD}-alice ~* &* +@all",
    ) as port:
        yield port


def _assert_config_error(op, *needles: str) -> str:
    with pytest.raises(StoreConfigError) as caught:
        op()
    message = str(caught.value)
    for needle in needles:
        assert needle in message, message
    assert PASSWORD not in message
    return message


def test_redis_password(auth_redis):
    host = f"127.0.0.1:{auth_redis}"
    with open_store(f"redis://:{PASSWORD}@{host}/0", secret=SECRET) as s:
        s.put(KEY, 0, b"behind a password")
        assert s.get(KEY, 0) == b"behind a password"
        assert PASSWORD not in repr(s) and PASSWORD not in s.label
        assert PASSWORD not in str(s.stats().to_dict())
    _assert_config_error(
        lambda: open_store(f"redis://:wrong-{PASSWORD}x@{host}/0"),
        f"authentication failed for user 'default' at {host}",
        "check the password or the ACL user",
    )
    _assert_config_error(
        lambda: open_store(f"redis://{host}/0"), "authentication failed", "gives none"
    )


def test_redis_password_from_a_file_or_the_environment(auth_redis, tmp_path, monkeypatch):
    """A password named by ``password_file`` or ``password_env``, never written in the URL:
    the store's URL and label show where it is, not what it is."""
    host = f"127.0.0.1:{auth_redis}"
    good = private_file(tmp_path / "pw", PASSWORD + "\n")  # echo's line break is not part of it
    monkeypatch.setenv("CACHEGEN_TEST_REDIS_PASSWORD", f"{PASSWORD}-alice")
    for url in (
        f"redis://{host}/0?password_file={good}",
        f"redis://alice@{host}/0?password_env=CACHEGEN_TEST_REDIS_PASSWORD&timeout_s=2",
    ):
        with open_store(url, secret=SECRET) as s:
            s.put(KEY, 2, b"behind a named password")
            assert s.get(KEY, 2) == b"behind a named password"
            assert s.url == url and s.label == url
            assert PASSWORD not in repr(s) and PASSWORD not in str(s.stats().to_dict())
    _assert_config_error(
        lambda: open_store(f"redis://{host}/0?password_file={private_file(tmp_path / 'x', 'x')}"),
        "authentication failed",
        "check the password",
    )


def test_a_password_file_or_variable_that_cannot_serve_is_refused_by_name(
    auth_redis, tmp_path, monkeypatch
):
    host = f"127.0.0.1:{auth_redis}"
    shared = private_file(tmp_path / "shared", PASSWORD)
    shared.chmod(0o640)
    empty = private_file(tmp_path / "empty", "\n")
    monkeypatch.setenv("CACHEGEN_TEST_EMPTY", "")
    monkeypatch.delenv("CACHEGEN_TEST_UNSET", raising=False)
    cases = {
        f"password_file={shared}": (str(shared), "group or others", "chmod 600"),
        f"password_file={tmp_path / 'absent'}": ("absent", "does not exist"),
        f"password_file={empty}": (str(empty), "is empty"),
        f"password_file={tmp_path}": (str(tmp_path), "not a regular file"),
        "password_env=CACHEGEN_TEST_EMPTY": ("CACHEGEN_TEST_EMPTY", "is empty"),
        "password_env=CACHEGEN_TEST_UNSET": ("CACHEGEN_TEST_UNSET", "is not set"),
        f"password_file={shared}&password_env=X": ("more than once",),
        f"password={PASSWORD}": ("password_file", "password_env"),
    }
    for query, needles in cases.items():
        _assert_config_error(lambda q=query: open_store(f"redis://{host}/0?{q}"), *needles)
    _assert_config_error(
        lambda: open_store(f"redis://:{PASSWORD}@{host}/0?password_file={shared}"),
        "more than once",
    )


def test_redis_acl_user(auth_redis):
    host = f"127.0.0.1:{auth_redis}"
    with open_store(f"redis://alice:{PASSWORD}-alice@{host}/0") as s:
        s.put(KEY, 1, b"alice's chunk")
        assert s.get(KEY, 1) == b"alice's chunk"
    for user, password in (("alice", f"{PASSWORD}-wrong"), ("bob", f"{PASSWORD}-alice")):
        _assert_config_error(
            lambda: open_store(f"redis://{user}:{password}@{host}/0"),
            f"authentication failed for user '{user}' at {host}",
            "check the password or the ACL user",
        )


def _tls_conf(certs: Path) -> list[str]:
    """redis.conf lines: TLS on the server's port with the test CA's certificate, no client
    certificates."""
    return [
        f"tls-cert-file {certs / 'server.crt'}",
        f"tls-key-file {certs / 'server.key'}",
        f"tls-ca-cert-file {certs / 'ca.crt'}",
        "tls-auth-clients no",
    ]


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory, certs):
    require_tool("redis-server")
    with configured_redis(
        tmp_path_factory.mktemp("tls"),
        *_tls_conf(certs),
    ) as port:
        yield port


def test_redis_tls(tls_redis, certs):
    url = f"rediss://127.0.0.1:{tls_redis}/0"
    with open_store(f"{url}?ssl_ca_certs={certs / 'ca.crt'}", secret=SECRET) as s:
        s.put(KEY, 0, b"over TLS")
        assert s.get(KEY, 0) == b"over TLS"
    with open_store(url, ssl_ca_certs=str(certs / "ca.crt"), ssl_cert_reqs="required") as s:
        assert s.get(KEY, 0) == b"over TLS"  # keyword options; no secret: the MAC is unchecked
    for extra in ({}, {"ssl_ca_certs": str(certs / "other-ca.crt")}):
        _assert_config_error(
            lambda: open_store(url, **extra), "certificate", "could not be verified", "ssl_ca_certs"
        )
    with open_store(url, ssl_cert_reqs="none") as s:  # explicitly unverified
        assert s.exists(KEY, 0)
    # The certificate names 127.0.0.1 only: signed by the right CA, but for another host.
    other_host = f"rediss://localhost:{tls_redis}/0?ssl_ca_certs={certs / 'ca.crt'}"
    _assert_config_error(
        lambda: open_store(other_host), "does not name that host", "localhost", "subjectAltName"
    )
    with open_store(f"{other_host}&ssl_cert_reqs=none") as s:  # explicitly unverified
        assert s.exists(KEY, 0)
    _assert_config_error(
        lambda: open_store(f"redis://127.0.0.1:{tls_redis}/0?ssl_ca_certs={certs / 'ca.crt'}"),
        "rediss://",
    )
    _assert_config_error(lambda: open_store(url, ssl_cert_reqs="maybe"), "ssl_cert_reqs")


def test_redis_unreachable_is_unavailable_at_first_use_not_at_open():
    port = free_port()  # nothing listens there
    store = open_store(f"redis://:{PASSWORD}@127.0.0.1:{port}/0?timeout_s=1")
    with pytest.raises(StoreUnavailable, match="unreachable") as caught:
        store.exists_many(["ns/abc"], 0)
    assert PASSWORD not in str(caught.value)
    with pytest.raises(StoreConfigError, match="scheme") as caught:
        open_store(f"ftp://user:{PASSWORD}@host/x")
    assert PASSWORD not in str(caught.value) and "user:***@host" in str(caught.value)


# ---- size cap --------------------------------------------------------------------------------


def test_local_size_cap(tmp_path, monkeypatch):
    import cachegen.store.local as local

    url = (tmp_path / "s").as_uri()
    with open_store(url) as uncapped:
        uncapped.put(KEY, 0, b"B" * 20_000)
    reads: list[int] = []
    real_open = open

    class Spy:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=-1):
            data = self.f.read(n)
            reads.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(local, "open", lambda *a, **k: Spy(real_open(*a, **k)), raising=False)
    capped = open_store(url + "?max_record_bytes=8kb")
    assert capped.max_record_bytes == 8000
    with pytest.raises(ChunkTooLarge) as caught:
        capped.get(KEY, 0)
    message = str(caught.value)
    assert all(s in message for s in (KEY, "level 0", "20064", "8000", "max_record_bytes"))
    with pytest.raises(ChunkTooLarge):
        list(capped.get_stream(KEY, 0))
    assert sum(reads) == 0  # refused from the file's size, before reading
    with pytest.raises(ChunkTooLarge, match="not stored"):
        capped.put(OTHER_KEY, 0, b"C" * 9000)
    assert not capped.exists(OTHER_KEY, 0)
    capped.put(OTHER_KEY, 0, b"C" * 7000)
    assert capped.get(OTHER_KEY, 0) == b"C" * 7000
    signed = open_store(url, secret=SECRET, max_record_bytes=7100)
    with pytest.raises(ChunkTooLarge):  # the signed header is 32 bytes longer
        signed.put(OTHER_KEY, 0, b"C" * 7010)


def test_redis_size_cap(redis_url, monkeypatch):
    location = redis_url
    with open_store(location) as uncapped:
        uncapped.put(KEY, 2, b"R" * 50_000)
    capped = open_store(location, max_record_bytes=10_000)
    calls: list[str] = []
    for name in ("get", "getrange"):
        real = getattr(capped._r, name)
        monkeypatch.setattr(
            capped._r, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k)
        )
    with pytest.raises(ChunkTooLarge, match="50064 bytes") as caught:
        capped.get(KEY, 2)
    assert "10000" in str(caught.value) and "get" not in calls  # STRLEN, never GET
    with pytest.raises(ChunkTooLarge):
        list(capped.get_stream(KEY, 2, block_size=4096))
    assert calls == ["getrange"]  # the header only
    with pytest.raises(ChunkTooLarge, match="not stored"):
        capped.put(OTHER_KEY, 2, b"R" * 10_000)
    assert not capped.exists(OTHER_KEY, 2)
    capped.put(OTHER_KEY, 2, b"r" * 9_000)
    assert capped.get(OTHER_KEY, 2) == b"r" * 9_000
    with pytest.raises(StoreConfigError, match="max_record_bytes"):
        open_store(location, max_record_bytes=10)


def test_a_short_secret_is_refused(tmp_path):
    with pytest.raises(StoreConfigError, match="at least 16") as caught:
        open_store(tmp_path.as_uri(), secret="hunter2")
    assert "hunter2" not in str(caught.value)


# ---- through the connector ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_acl_redis(tmp_path_factory, certs):
    """TLS and an ACL user (no default user): what a shared production Redis looks like."""
    require_tool("redis-server")
    with configured_redis(
        tmp_path_factory.mktemp("tls-acl"),
        *_tls_conf(certs),
        "user default off",
        f"user alice on >{PASSWORD} ~* &* +@all",
    ) as port:
        password = private_file(tmp_path_factory.mktemp("tls-acl-pw") / "pw", PASSWORD)
        yield (
            f"rediss://alice@127.0.0.1:{port}/0?ssl_ca_certs={certs / 'ca.crt'}"
            f"&password_file={password}"
        )


def _transport(spec, store_url: str, **extra):
    from cachegen.connector.config import ConnectorConfig
    from cachegen.connector.transport import ChunkTransport

    config = ConnectorConfig.from_extra_config({"store": store_url, "chunk_tokens": 256, **extra})
    return ChunkTransport(config, spec, spec.identity())


def test_connector_start_up_names_the_wrong_setting(tls_acl_redis, tiny_llama, tmp_path):
    from cachegen.connector.errors import ConnectorError

    wrong_password = private_file(tmp_path / "wrong", f"{PASSWORD}-wrong")
    wrong = {  # the URL names its password file: "password" alone would be in every message
        "for user 'alice'": tls_acl_redis.split("&password_file=")[0]
        + f"&password_file={wrong_password}",
        "for user 'mallory'": tls_acl_redis.replace("alice@", "mallory@"),
        "certificate": tls_acl_redis.replace("ca.crt", "other-ca.crt"),
        "rediss://": tls_acl_redis.replace("rediss://", "redis://"),
    }
    for needle, url in wrong.items():
        with pytest.raises(ConnectorError, match="cannot open the KV store") as caught:
            _transport(tiny_llama, url)
        assert needle in str(caught.value) and PASSWORD not in str(caught.value)
    short = private_file(tmp_path / "short-secret", "short")
    with pytest.raises(ConnectorError, match="at least 16"):
        _transport(tiny_llama, tls_acl_redis, store_secret_file=str(short))


def test_connector_over_tls_with_an_acl_user_end_to_end(tls_acl_redis, smollm2, tmp_path):
    """vLLM with the connector on a Redis that needs TLS and an ACL user (its password in a
    file), records signed (the secret in a file): a stored prefix loads directly and through
    the rate-limited chunk server."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from cachegen import workload
    from cachegen_lab.bench.engine import ConnectorEngine

    with ConnectorEngine(
        smollm2,
        store=tls_acl_redis,
        save_modes=("int8",),
        max_model_len=1024,
        connector_extra={"store_secret_file": str(private_file(tmp_path / "secret", SECRET))},
    ) as engine:
        prompt = engine.tokenize(workload.text("eval")[:8000])[:512] + engine.tokenize(
            "\n\nSummary:", bos=False
        )
        engine.store_prefix(prompt)
        for bandwidth in (None, 1000.0):
            hit = engine.run(prompt, mode="int8", bandwidth_mbps=bandwidth, max_tokens=4)
            assert hit.connector["loaded_tokens"] == 512, hit.connector
    with open_store(tls_acl_redis, secret=SECRET) as store:
        assert store.signed and store.stats().chunks >= 2
