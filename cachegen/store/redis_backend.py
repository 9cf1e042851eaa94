"""The Redis chunk store: one real redis-server (or Valkey, or a Redis Cluster) shared by
several serving machines.

Each ``(key, level)`` is one string value ``<prefix>:{<key>}:L<level>`` holding the record
(see record.py). The ``{key}`` hash tag keeps all levels of a chunk in one cluster slot.
``SET`` replaces a value atomically, so readers never see a partial chunk.

The store never changes the server's settings (no CONFIG SET: the server may be shared).
Chunks expire after ``ttl_s`` (optional); the codec's tables, model files, profiles and
pointers never expire, so a server whose ``maxmemory-policy`` evicts only keys with a TTL
(``volatile-lru``) evicts chunks and never what they need. ``max_memory`` (which needs
``ttl_s``) makes the store check at open, read-only, that the server is set up so: its
``maxmemory`` set and at most ``max_memory``, its policy a ``volatile-*`` one
(``cachegen.store.redis_memory``). Should the tables go anyway (deleted, or a server set up
otherwise), consumers stop counting the chunks that need them as hits and the producer's next
save that stores a chunk puts them back (``cachegen.store.tables.republish_profile``).

The URL names a password (``redis://host/0?password_file=PATH`` or ``?password_env=NAME``;
``cachegen.store.secret_files``) and an ACL user (``redis://USER@host/0?password_file=...``);
``rediss://`` speaks TLS, verified against ``ssl_ca_certs``. Opening the store sends one PING,
so wrong credentials or an untrusted certificate fail at once with ``StoreConfigError``.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Sequence

from cachegen.store import record, redis_memory
from cachegen.store.base import ChunkInfo, ChunkStore, lru_victims
from cachegen.store.errors import ChunkMissing, StoreConfigError, StoreError
from cachegen.store.keys import validate_key, validate_level
from cachegen.store.profile_records import describe, record_too_large
from cachegen.store.redis_connection import RedisEndpoint

PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
ENTRY_RE = re.compile(r"^(?P<prefix>[^:]+):\{(?P<key>[^}]+)\}:L(?P<level>\d+)$")
SCAN_BATCH = 1000


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
        redis_memory.check_options(max_memory, ttl_s)
        self.url = public_url or url
        self._server = RedisEndpoint(self.url, cluster=cluster)
        self._label = self._server.label  # for messages and logs
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.max_memory = max_memory
        self.cluster = cluster
        tls = dict(
            ssl_ca_certs=ssl_ca_certs,
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
            ssl_cert_reqs=ssl_cert_reqs,
        )
        self._r = self._server.connect(url, timeout_s=timeout_s, retries=retries, tls=tls)
        if max_memory is not None:
            redis_memory.check_server(self._r, self._server, int(max_memory))

    def _name(self, key: str, level: int) -> str:
        return f"{self.prefix}:{{{validate_key(key)}}}:L{validate_level(level)}"

    def put(self, key: str, level: int, blob: bytes) -> None:
        name = self._name(key, level)
        data = self._pack(key, level, blob)
        with self._server.errors(f"store chunk {key} level {level}"):
            self._r.set(name, data, ex=self.ttl_s)

    def get_record(self, key: str, level: int) -> bytes:
        name = self._name(key, level)
        with self._server.errors(f"read chunk {key} level {level}"):
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
            with self._server.errors(f"read {len(asked)} chunks"):
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
                with self._server.errors(f"read chunk {key} level {level}"):
                    raise reply
            if not reply:  # GET: None; GETRANGE: b"" (a record is never empty)
                raise ChunkMissing(f"chunk {key} level {level} is not in {self._label}")
            self._check_record_size(key, level, len(reply))
        except StoreError as exc:
            return exc
        return reply

    def _read_range(self, key: str, level: int, offset: int, length: int) -> bytes:
        name = self._name(key, level)
        with self._server.errors(f"read chunk {key} level {level}"):
            data = self._r.getrange(name, offset, offset + length - 1)
            if offset == 0 and not data and not self._r.exists(name):
                raise ChunkMissing(f"chunk {key} level {level} is not in {self._label}")
        return data

    def exists_many(self, keys: Sequence[str], level: int) -> list[bool]:
        names = [self._name(k, level) for k in keys]
        with self._server.errors("look up chunks"):
            pipe = self._r.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return [bool(n) for n in pipe.execute()]

    def sizes(self, keys: Sequence[str], level: int) -> list[int | None]:
        names = [self._name(k, level) for k in keys]
        with self._server.errors("look up chunk sizes"):
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
        with self._server.errors(f"delete chunk {key}"):
            return sum(self._r.delete(name) for name in names)

    def list(self, prefix: str = "") -> Iterator[ChunkInfo]:
        return self._scan(prefix, exact=False)

    def _scan(self, key_prefix: str, exact: bool) -> Iterator[ChunkInfo]:
        pattern = f"{self.prefix}:{{{key_prefix}{'' if exact else '*'}}}:L*"
        with self._server.errors("list chunks"):
            names = list(self._r.scan_iter(match=pattern, count=SCAN_BATCH))
        now = time.time()
        for start in range(0, len(names), SCAN_BATCH):
            batch = names[start : start + SCAN_BATCH]
            with self._server.errors("list chunks"):
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
        removed = 0
        for entry in lru_victims(self.list(), max_bytes)[0]:
            with self._server.errors("evict chunks"):
                removed += self._r.delete(self._name(entry.key, entry.level))
        return removed

    # Profile tables under <prefix>:tables:<id>, model files under <prefix>:model-files:<id>,
    # codec profiles under <prefix>:profiles:<id> and pointers under <prefix>:adopted:<name>:
    # outside the chunks' <prefix>:{key}:L<level> pattern, with no TTL (a chunk stored after
    # them may outlive any TTL they would get, and a volatile-* policy never evicts them).

    def _read_meta(self, kind: str, name: str, cap: int) -> bytes | None:
        with self._server.errors(f"read {describe(kind, name)}"):
            size = self._r.strlen(f"{self.prefix}:{kind}:{name}")
            if size > cap:
                raise record_too_large(kind, name, size, cap)
            return self._r.get(f"{self.prefix}:{kind}:{name}") if size else None

    def _write_meta(self, kind: str, name: str, data: bytes, *, exclusive: bool) -> bool:
        with self._server.errors(f"store {describe(kind, name)}"):  # SET NX: first writer wins
            return bool(self._r.set(f"{self.prefix}:{kind}:{name}", data, nx=exclusive))

    def _holds_meta(self, records: Sequence[tuple[str, str]]) -> list[bool]:
        with self._server.errors("look up profile records"):
            pipe = self._r.pipeline(transaction=False)
            for kind, name in records:
                pipe.exists(f"{self.prefix}:{kind}:{name}")
            return [bool(n) for n in pipe.execute()] if records else []

    def _delete_meta(self, kind: str, name: str) -> bool:
        with self._server.errors(f"delete {describe(kind, name)}"):
            return bool(self._r.delete(f"{self.prefix}:{kind}:{name}"))

    def _list_meta(self, kind: str) -> list[str]:
        head = f"{self.prefix}:{kind}:"
        with self._server.errors(f"list {kind} records"):
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
