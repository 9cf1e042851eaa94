"""``open_store(url)``: one factory from a URL to a chunk store.

    file:///abs/dir[?max_bytes=2gb&fsync=1]     local directory (a plain path works too)
    redis://host:port/db[?ttl_s=3600&max_memory=1gb&prefix=cachegen&timeout_s=5]
    redis://host:port/db?password_file=/path     a password (requirepass) read from a file
    redis://USER@host:port/db?password_env=NAME  an ACL user, its password in $NAME
    redis://USER:PASSWORD@host:port/db           a password inline (Python code only: the
                                                  connector and the CLI refuse it)
    rediss://host:port/db?ssl_ca_certs=/ca.pem   the same over TLS (ssl_certfile, ssl_keyfile
                                                  for a client certificate; ssl_cert_reqs)
    valkey://host:port/db                         Valkey (speaks the Redis protocol)
    redis+cluster://host:port                     a Redis Cluster, any node as entry point

Every store also takes ``max_record_bytes`` (refuse records larger than this). Options may
also be given as keyword arguments; they override the URL's query (``password_file`` and
``password_env`` are URL-only, so that the URL reopens the store elsewhere). The store secret
that signs records is never part of a URL: ``open_store(url, secret=...)`` or the environment
variable ``CACHEGEN_STORE_SECRET``.
"""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from cachegen.constants import cache_root
from cachegen.store.base import ChunkStore
from cachegen.store.errors import StoreConfigError
from cachegen.store.secret_files import PASSWORD_ENV, PASSWORD_FILE, named_password

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}  # fmt: skip
LOCAL_OPTIONS = {"max_bytes": "size", "fsync": "bool", "max_record_bytes": "size"}
REDIS_OPTIONS = {
    "ttl_s": "int",
    "max_memory": "size",
    "prefix": "str",
    "timeout_s": "float",
    "retries": "int",
    "max_record_bytes": "size",
    "ssl_ca_certs": "str",
    "ssl_certfile": "str",
    "ssl_keyfile": "str",
    "ssl_cert_reqs": "str",
}
_SECRET_NAMES = ("secret", "store_secret")


def default_store_url() -> str:
    return "file://" + os.path.abspath(cache_root() / "chunks")


def parse_size(text: str | int) -> int:
    """``"512mb"``, ``"1GiB"``, ``"100000"`` -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise StoreConfigError(
            f"cannot read size {text!r}: use bytes or a unit such as 512mb, 2gb, 1GiB"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def _convert(name: str, kind: str, value):
    if not isinstance(value, str):
        return value
    try:
        if kind == "size":
            return parse_size(value)
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            return value.lower() in ("1", "true", "yes", "on")
        return value
    except ValueError:
        raise StoreConfigError(f"store option {name}={value!r} is not a valid {kind}") from None


def without_password(url: str) -> str:
    """``url`` with its password (if any, inline or in a ``password`` query option) replaced
    by ``***``: what messages and logs show."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    queried = any(name == "password" for name, _ in query)
    if parts.password is None and not queried:
        return url
    if queried:
        hidden = [(name, "***" if name == "password" else value) for name, value in query]
        parts = parts._replace(query=urlencode(hidden, safe="*/"))
    if parts.password is not None:
        host = parts.netloc.rsplit("@", 1)[1]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    return urlunsplit(parts)


def _with_password(netloc: str, password: str) -> str:
    """``netloc`` (``[USER@]HOST:PORT``, no password) with ``password`` added: the address
    only redis-py sees, never shown."""
    user, _, host = netloc.rpartition("@")
    return f"{user}:{quote(password, safe='')}@{host}"


def _split_options(
    query: str, known: dict[str, str], overrides: dict, consumed: tuple[str, ...] = ()
) -> tuple[dict, str]:
    """The store options of ``query`` (``known``) with ``overrides`` on top, and the rest of
    the query (for redis-py), without the ``consumed`` names."""
    ours, rest = {}, []
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name.lower() in _SECRET_NAMES:
            raise StoreConfigError(
                "a store secret cannot be given in the store URL (URLs are shown in messages "
                "and logs): pass open_store(url, secret=...) or set CACHEGEN_STORE_SECRET"
            )
        if name in consumed:
            continue
        (ours.__setitem__(name, value) if name in known else rest.append((name, value)))
    ours.update(overrides)
    unknown = set(overrides) - set(known)
    if unknown:
        raise StoreConfigError(f"unknown store option(s) {sorted(unknown)}; known: {sorted(known)}")
    return {k: _convert(k, known[k], v) for k, v in ours.items()}, urlencode(rest)


def open_store(
    url: str | None = None, *, secret: bytes | str | None = None, **options
) -> ChunkStore:
    """Open the chunk store at ``url`` (default: a directory in the user cache).

    ``secret`` signs every record written and makes reads refuse records not signed with it
    (``ChunkForged``); None reads the environment variable ``CACHEGEN_STORE_SECRET``, and an
    empty value (either way) means no secret. A Redis store checks its connection (one PING)
    here: wrong credentials or an untrusted certificate raise ``StoreConfigError``, a server
    that cannot be reached ``StoreUnavailable``.
    """
    url = url or default_store_url()
    shown = without_password(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("", "file"):
        from cachegen.store.local import LocalStore

        if scheme == "file" and parts.netloc not in ("", "localhost"):
            raise StoreConfigError(
                f"file URL {shown!r} names host {parts.hostname!r}; use file:///absolute/path"
            )
        path = unquote(parts.path) if scheme == "file" else url.split("?", 1)[0]
        if not path:
            raise StoreConfigError(f"store URL {shown!r} has no path")
        opts, rest = _split_options(parts.query, LOCAL_OPTIONS, options)
        if rest:
            raise StoreConfigError(
                f"unknown option(s) in {shown!r}; known: {sorted(LOCAL_OPTIONS)}"
            )
        return LocalStore(path, secret=secret, **opts)
    if scheme in ("redis", "rediss", "valkey", "valkeys", "redis+cluster", "rediss+cluster"):
        from cachegen.store.redis_backend import RedisStore

        password = named_password(url)
        opts, rest = _split_options(
            parts.query, REDIS_OPTIONS, options, consumed=(PASSWORD_FILE, PASSWORD_ENV)
        )
        cluster = scheme.endswith("+cluster")
        wire_scheme = {"valkey": "redis", "valkeys": "rediss"}.get(
            scheme, scheme.removesuffix("+cluster")
        )
        netloc = parts.netloc if password is None else _with_password(parts.netloc, password)
        client_url = urlunsplit((wire_scheme, netloc, parts.path, rest, ""))
        return RedisStore(client_url, cluster=cluster, public_url=url, secret=secret, **opts)
    raise StoreConfigError(
        f"unknown store URL scheme {parts.scheme!r} in {shown!r}; use file:///dir, "
        "redis://host:port/db, valkey://host:port/db or redis+cluster://host:port"
    )
