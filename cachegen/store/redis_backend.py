"""The Redis chunk store: one real redis-server (or Valkey, or a Redis Cluster) shared by
several serving machines.

Each ``(key, level)`` is one string value ``<prefix>:{<key>}:L<level>`` holding the record
(see record.py). The ``{key}`` hash tag keeps all levels of a chunk in one cluster slot.
``SET`` replaces a value atomically, so readers never see a partial chunk. A TTL (``ttl_s``)
and a memory bound (``max_memory``, which sets ``maxmemory`` with ``allkeys-lru`` on the
server) are optional.

The URL carries a password (``redis://:PASS@host``) or an ACL user (``redis://USER:PASS@host``);
``rediss://`` speaks TLS, verified against ``ssl_ca_certs``. Opening the store sends one PING,
so wrong credentials or an untrusted certificate fail at once with ``StoreConfigError``.
"""

from __future__ import annotations

import contextlib
import os
import re
import ssl
import time
from collections.abc import Iterator, Sequence
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from cachegen.store import record
from cachegen.store.base import ChunkInfo, ChunkStore, meta_too_large, tables_too_large
from cachegen.store.errors import ChunkMissing, StoreConfigError, StoreError, StoreUnavailable
from cachegen.store.keys import validate_key, validate_level
from cachegen.store.url import without_password

PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
ENTRY_RE = re.compile(r"^(?P<prefix>[^:]+):\{(?P<key>[^}]+)\}:L(?P<level>\d+)$")
SCAN_BATCH = 1000
CERT_REQS = ("none", "optional", "required")
_UNREACHABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.RedisClusterException,
)
SSL_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


class RedisStore(ChunkStore):
    def __init__(
        self,
        url: str,
        *,
        cluster: bool = False,
        prefix: str = "cachegen",
        ttl_s: int | None = None,
        max_memory: int | None = None,
        timeout_s: float = 5.0,
        retries: int = 1,
        public_url: str | None = None,
        secret: bytes | str | None = None,
        max_record_bytes: int | None = None,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_cert_reqs: str | None = None,
    ) -> None:
        """``url`` is what redis-py connects to; ``public_url`` (default ``url``) is the URL
        ``open_store`` was given, which reopens this same store elsewhere (a server process).

        ``secret``: sign and verify records (None: ``CACHEGEN_STORE_SECRET``, empty: none);
        ``max_record_bytes``: the largest record (header + payload) written or read;
        ``ssl_*`` (``rediss://`` only): CA file, client certificate and key, and whether the
        server's certificate is verified (``ssl_cert_reqs``: none, optional, required).
        """
        self._init_records(secret, max_record_bytes)
        if not PREFIX_RE.match(prefix):
            raise StoreConfigError(
                f"redis key prefix {prefix!r} must be 1-32 letters, digits, '_' or '-'"
            )
        if ttl_s is not None and ttl_s <= 0:
            raise StoreConfigError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        self.url = public_url or url
        self._label = without_password(self.url)  # for messages and logs
        parts = urlsplit(self.url)
        self._user = unquote(parts.username) if parts.username else "default"
        self._has_password = parts.password is not None
        self._host = _host_port(parts)
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.max_memory = max_memory
        # Few, fast retries: a dead server must turn into StoreUnavailable within about
        # timeout_s, so the caller can recompute instead of waiting on backoff.
        options = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries),
        )
        options.update(
            _ssl_options(
                urlsplit(url).scheme.lower() == "rediss",
                ssl_ca_certs=ssl_ca_certs,
                ssl_certfile=ssl_certfile,
                ssl_keyfile=ssl_keyfile,
                ssl_cert_reqs=ssl_cert_reqs,
            )
        )
        try:
            if cluster:
                self._r = RedisCluster.from_url(url, **options)
            else:
                self._r = redis.Redis.from_url(url, **options)
        except (
            ValueError,
            redis.exceptions.RedisError,
            redis.exceptions.RedisClusterException,
        ) as exc:
            # A cluster client connects here: credentials and certificates are checked now.
            error = self._config_error(exc)
            if error is None and isinstance(exc, _UNREACHABLE):
                error = StoreUnavailable(
                    f"redis at {self._label} is unreachable (connect): {self._redact(exc)}"
                )
            raise error or StoreConfigError(
                f"cannot use redis store {self._label}: {self._redact(exc)}"
            ) from exc
        self.cluster = cluster
        self._ping()
        if max_memory is not None:
            with self._errors("configure maxmemory"):
                self._r.config_set("maxmemory", int(max_memory))
                self._r.config_set("maxmemory-policy", "allkeys-lru")

    def _ping(self) -> None:
        """One PING: wrong credentials or an untrusted certificate are configuration errors. A
        server that cannot be reached is not: the first operation that needs it raises
        ``StoreUnavailable``, so an engine can start while its store is down, and recompute."""
        try:
            self._r.ping()
        except Exception as exc:
            error = self._config_error(exc)
            if error is not None:
                raise error from exc

    def _config_error(self, exc: BaseException) -> StoreConfigError | None:
        """The configuration mistake ``exc`` reveals (credentials, TLS), if any."""
        chain = _chain(exc)
        said = self._redact("; ".join(dict.fromkeys(str(e) for e in chain if str(e))))
        if any(isinstance(e, redis.exceptions.AuthenticationError) for e in chain) or any(
            code in said for code in ("WRONGPASS", "NOAUTH", "invalid password")
        ):
            hint = (
                "check the password or the ACL user"
                if self._has_password
                else "check the password or the ACL user: the server requires one and the URL "
                "gives none (redis://:PASSWORD@host:port/db or redis://USER:PASSWORD@...)"
            )
            return StoreConfigError(
                f"authentication failed for user {self._user!r} at {self._host}: {hint} "
                f"(redis said: {_first_line(said)})"
            )
        if any(isinstance(e, redis.exceptions.NoPermissionError) for e in chain):
            return StoreConfigError(
                f"user {self._user!r} at {self._host} is not allowed to run the commands the "
                f"chunk store needs: check the user's ACL rules (redis said: {_first_line(said)})"
            )
        cert = next((e for e in chain if isinstance(e, ssl.SSLCertVerificationError)), None)
        if cert is not None or "CERTIFICATE_VERIFY_FAILED" in said:
            reason = getattr(cert, "verify_message", None) or _first_line(said)
            return StoreConfigError(
                f"the TLS certificate of redis at {self._host} could not be verified ({reason}): "
                "set the store option ssl_ca_certs to the CA certificate that signed the "
                "server's certificate (URL ?ssl_ca_certs=/path/ca.pem or open_store(..., "
                "ssl_ca_certs=...)) and check that the certificate names this host"
            )
        tls = next((e for e in chain if isinstance(e, ssl.SSLError)), None)
        if tls is not None:
            return StoreConfigError(
                f"the TLS handshake with redis at {self._host} failed "
                f"({tls.reason or _first_line(str(tls))}): check that the server speaks TLS on "
                "this port, and ssl_certfile / ssl_keyfile if it requires a client certificate"
            )
        return None

    def _redact(self, text: object) -> str:
        """``text`` with the URL's password (should a message ever echo it) replaced by ***."""
        text, password = str(text), urlsplit(self.url).password
        for secret in {password, unquote(password or "")} - {None, ""}:
            text = text.replace(secret, "***")
        return text

    @contextlib.contextmanager
    def _errors(self, what: str):
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            # In a cluster a dead node leaves its slots unavailable (until a replica takes over,
            # or for good without quorum): the message says it is the cluster that is down.
            state = "unavailable: a node is unreachable" if self.cluster else "unreachable"
            kind = "redis cluster" if self.cluster else "redis"
            raise StoreUnavailable(
                f"{kind} at {self._label} is {state} ({what}): {self._redact(exc)}"
            ) from exc
        except (redis.exceptions.RedisClusterException, redis.exceptions.ClusterDownError) as exc:
            # ClusterDownError (CLUSTERDOWN, MASTERDOWN: a slot range lost its master and every
            # replica) is a RedisError reply, not a refusal: the cluster cannot serve right now.
            raise StoreUnavailable(
                f"redis cluster at {self._label} is unavailable ({what}): {self._redact(exc)}"
            ) from exc
        except redis.exceptions.RedisError as exc:
            raise StoreError(
                f"redis at {self._label} refused to {what}: {self._redact(exc)}"
            ) from exc

    def _name(self, key: str, level: int) -> str:
        return f"{self.prefix}:{{{validate_key(key)}}}:L{validate_level(level)}"

    def put(self, key: str, level: int, blob: bytes) -> None:
        name = self._name(key, level)
        data = self._pack(key, level, blob)
        with self._errors(f"store chunk {key} level {level}"):
            self._r.set(name, data, ex=self.ttl_s)

    def get_record(self, key: str, level: int) -> bytes:
        name = self._name(key, level)
        with self._errors(f"read chunk {key} level {level}"):
            if self.max_record_bytes is not None:  # the size first: an oversized value stays
                self._check_record_size(key, level, self._r.strlen(name))  # on the server
            data = self._r.get(name)
        if data is None:
            raise ChunkMissing(f"chunk {key} level {level} is not in {self._label}")
        self._check_record_size(key, level, len(data))  # replaced by a larger one meanwhile
        return data

    def get_records(self, items: Sequence[tuple[str, int]]) -> list[bytes | StoreError]:
        """One pipelined round trip (a cluster pipeline sends each node its keys). With a
        record cap, GETRANGE reads at most one byte over it, so an oversized value stays on
        the server. A failed round trip fails every pair in it alike."""
        out: list[bytes | StoreError | None] = [None] * len(items)
        asked: dict[int, str] = {}  # index -> redis name, for the pairs with a valid key
        for i, (key, level) in enumerate(items):
            try:
                asked[i] = self._name(key, level)
            except StoreError as exc:
                out[i] = exc
        cap = self.max_record_bytes
        try:
            with self._errors(f"read {len(asked)} chunks"):
                pipe = self._r.pipeline(transaction=False)
                for name in asked.values():
                    if cap is None:
                        pipe.get(name)
                    else:
                        pipe.getrange(name, 0, cap)
                replies = pipe.execute(raise_on_error=False) if asked else []
        except StoreError as exc:
            replies = [exc] * len(asked)
        for i, reply in zip(asked, replies):
            out[i] = self._record_or_error(*items[i], reply)
        return out

    def _record_or_error(self, key: str, level: int, reply) -> bytes | StoreError:
        """One pipelined reply as ``get_record`` would have returned or raised it."""
        if isinstance(reply, StoreError):
            return reply
        try:
            if isinstance(reply, Exception):
                with self._errors(f"read chunk {key} level {level}"):
                    raise reply
            if not reply:  # GET: None; GETRANGE: b"" (a record is never empty)
                raise ChunkMissing(f"chunk {key} level {level} is not in {self._label}")
            self._check_record_size(key, level, len(reply))
        except StoreError as exc:
            return exc
        return reply

    def _read_range(self, key: str, level: int, offset: int, length: int) -> bytes:
        name = self._name(key, level)
        with self._errors(f"read chunk {key} level {level}"):
            data = self._r.getrange(name, offset, offset + length - 1)
            if offset == 0 and not data and not self._r.exists(name):
                raise ChunkMissing(f"chunk {key} level {level} is not in {self._label}")
        return data

    def exists_many(self, keys: Sequence[str], level: int) -> list[bool]:
        names = [self._name(k, level) for k in keys]
        with self._errors("look up chunks"):
            pipe = self._r.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return [bool(n) for n in pipe.execute()]

    def sizes(self, keys: Sequence[str], level: int) -> list[int | None]:
        names = [self._name(k, level) for k in keys]
        with self._errors("look up chunk sizes"):
            pipe = self._r.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
                pipe.getrange(name, 0, 4)  # magic and format version: the header's length
            replies = pipe.execute()
        return [
            record.payload_size(head, n) if n else None
            for n, head in zip(replies[::2], replies[1::2])
        ]

    def levels(self, key: str) -> list[int]:
        return sorted(info.level for info in self._scan(validate_key(key), exact=True))

    def delete(self, key: str, level: int | None = None) -> int:
        names = [self._name(key, lv) for lv in (self.levels(key) if level is None else [level])]
        if not names:
            return 0
        with self._errors(f"delete chunk {key}"):
            return sum(self._r.delete(name) for name in names)

    def list(self, prefix: str = "") -> Iterator[ChunkInfo]:
        return self._scan(prefix, exact=False)

    def _scan(self, key_prefix: str, exact: bool) -> Iterator[ChunkInfo]:
        pattern = f"{self.prefix}:{{{key_prefix}{'' if exact else '*'}}}:L*"
        with self._errors("list chunks"):
            names = list(self._r.scan_iter(match=pattern, count=SCAN_BATCH))
        now = time.time()
        for start in range(0, len(names), SCAN_BATCH):
            batch = names[start : start + SCAN_BATCH]
            with self._errors("list chunks"):
                pipe = self._r.pipeline(transaction=False)
                for name in batch:
                    pipe.strlen(name)
                    pipe.object("idletime", name)
                    pipe.getrange(name, 0, 4)  # magic and format version: the header's length
                replies = pipe.execute(raise_on_error=False)
            for i, name in enumerate(batch):
                m = ENTRY_RE.match(name.decode() if isinstance(name, bytes) else name)
                length, idle, head = replies[3 * i : 3 * i + 3]
                if not m or not isinstance(length, int) or length == 0:
                    continue  # foreign key, or expired/evicted between SCAN and STRLEN
                last_used = now - idle if isinstance(idle, int) else None
                size = record.payload_size(head if isinstance(head, bytes) else b"", length)
                yield ChunkInfo(m["key"], int(m["level"]), size, last_used)

    def evict(self, max_bytes: int) -> int:
        if max_bytes < 0:
            raise StoreConfigError(f"max_bytes must be >= 0, got {max_bytes}")
        entries = sorted(self.list(), key=lambda e: e.last_used or 0.0)
        total = sum(e.size for e in entries)
        removed = 0
        for entry in entries:
            if total <= max_bytes:
                break
            with self._errors("evict chunks"):
                removed += self._r.delete(self._name(entry.key, entry.level))
            total -= entry.size
        return removed

    # Profile tables live under <prefix>:tables:<id>, outside the chunks' <prefix>:{key}:L<level>
    # pattern, with no TTL: a chunk stored after them may outlive any TTL they would get.

    def _read_tables_record(self, tables_id: str, cap: int) -> bytes | None:
        name = f"{self.prefix}:tables:{tables_id}"
        with self._errors(f"read profile tables {tables_id[:16]}"):
            size = self._r.strlen(name)
            if size > cap:
                raise tables_too_large(tables_id, size)
            return self._r.get(name) if size else None

    def _write_tables_record(self, tables_id: str, data: bytes) -> None:
        with self._errors(f"store profile tables {tables_id[:16]}"):
            self._r.set(f"{self.prefix}:tables:{tables_id}", data)

    # Codec profiles under <prefix>:profiles:<id> and pointers under <prefix>:adopted:<name>,
    # outside the chunks' pattern and with no TTL, like the tables.

    def _read_meta(self, kind: str, name: str, cap: int) -> bytes | None:
        with self._errors(f"read {kind} record {name[:16]}"):
            size = self._r.strlen(f"{self.prefix}:{kind}:{name}")
            if size > cap:
                raise meta_too_large(kind, name, size)
            return self._r.get(f"{self.prefix}:{kind}:{name}") if size else None

    def _write_meta(self, kind: str, name: str, data: bytes, *, exclusive: bool) -> bool:
        with self._errors(f"store {kind} record {name[:16]}"):  # SET NX: first writer wins
            return bool(self._r.set(f"{self.prefix}:{kind}:{name}", data, nx=exclusive))

    def _delete_meta(self, kind: str, name: str) -> bool:
        with self._errors(f"delete {kind} record {name[:16]}"):
            return bool(self._r.delete(f"{self.prefix}:{kind}:{name}"))

    def _list_meta(self, kind: str) -> list[str]:
        head = f"{self.prefix}:{kind}:"
        with self._errors(f"list {kind} records"):
            names = list(self._r.scan_iter(match=f"{head}*", count=SCAN_BATCH))
        return [(n.decode() if isinstance(n, bytes) else n)[len(head) :] for n in names]

    @property
    def capacity_bytes(self) -> int | None:
        return self.max_memory

    @property
    def label(self) -> str:
        return self._label

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._r.close()


def _ssl_options(tls: bool, **given: str | None) -> dict:
    """redis-py's keyword arguments for the ``ssl_*`` store options (``rediss://`` only)."""
    chosen = {name: value for name, value in given.items() if value is not None}
    if not tls:
        if chosen:
            raise StoreConfigError(
                f"store option(s) {sorted(chosen)} need a TLS URL: use rediss:// (or valkeys://, "
                "rediss+cluster://) instead of redis://"
            )
        return {}
    reqs = str(chosen.get("ssl_cert_reqs", "required")).lower()
    if reqs not in CERT_REQS:
        raise StoreConfigError(
            f"store option ssl_cert_reqs={reqs!r}: expected one of {', '.join(CERT_REQS)}"
        )
    for name in SSL_FILES:
        path = chosen.get(name)
        if path is not None and not os.path.isfile(os.path.expanduser(path)):
            raise StoreConfigError(f"store option {name}: {path!r} is not a readable file")
    out = {name: os.path.expanduser(chosen[name]) for name in SSL_FILES if name in chosen}
    out["ssl_cert_reqs"] = reqs
    return out


def _host_port(parts) -> str:
    host = parts.netloc.rsplit("@", 1)[-1]
    try:
        port = parts.port
    except ValueError:  # shown as written
        return host
    return host if port is not None or not host else f"{host}:6379"


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no details"
