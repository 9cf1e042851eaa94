"""The Redis chunk store: one real redis-server (or Valkey, or a Redis Cluster) shared by
several serving machines.

Each ``(key, level)`` is one string value ``<prefix>:{<key>}:L<level>`` holding the record
(see record.py). The ``{key}`` hash tag keeps all levels of a chunk in one cluster slot.
``SET`` replaces a value atomically, so readers never see a partial chunk. A TTL (``ttl_s``)
and a memory bound (``max_memory``, which sets ``maxmemory`` with ``allkeys-lru`` on the
server) are optional.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from cachegen.store import record
from cachegen.store.base import ChunkInfo, ChunkStore
from cachegen.store.errors import ChunkMissing, StoreConfigError, StoreError, StoreUnavailable
from cachegen.store.keys import validate_key, validate_level

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
    ) -> None:
        """``url`` is what redis-py connects to; ``public_url`` (default ``url``) is the URL
        ``open_store`` was given, which reopens this same store elsewhere (a server process)."""
        if not PREFIX_RE.match(prefix):
            raise StoreConfigError(
                f"redis key prefix {prefix!r} must be 1-32 letters, digits, '_' or '-'"
            )
        if ttl_s is not None and ttl_s <= 0:
            raise StoreConfigError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        self.url = public_url or url
        self._label = _without_password(self.url)  # for messages and logs
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
        try:
            if cluster:
                self._r = RedisCluster.from_url(url, **options)
            else:
                self._r = redis.Redis.from_url(url, **options)
        except (ValueError, redis.exceptions.RedisError) as exc:
            raise StoreConfigError(
                f"cannot use redis store {_without_password(url)}: {exc}"
            ) from exc
        self.cluster = cluster
        if max_memory is not None:
            with self._errors("configure maxmemory"):
                self._r.config_set("maxmemory", int(max_memory))
                self._r.config_set("maxmemory-policy", "allkeys-lru")

    @contextlib.contextmanager
    def _errors(self, what: str):
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StoreUnavailable(
                f"redis at {self._label} is unreachable ({what}): {exc}"
            ) from exc
        except redis.exceptions.RedisClusterException as exc:
            raise StoreUnavailable(
                f"redis cluster at {self._label} is unavailable ({what}): {exc}"
            ) from exc
        except redis.exceptions.RedisError as exc:
            raise StoreError(f"redis at {self._label} refused to {what}: {exc}") from exc

    def _name(self, key: str, level: int) -> str:
        return f"{self.prefix}:{{{validate_key(key)}}}:L{validate_level(level)}"

    def put(self, key: str, level: int, blob: bytes) -> None:
        name = self._name(key, level)
        with self._errors(f"store chunk {key} level {level}"):
            self._r.set(name, record.pack(key, level, blob), ex=self.ttl_s)

    def get_record(self, key: str, level: int) -> bytes:
        name = self._name(key, level)
        with self._errors(f"read chunk {key} level {level}"):
            data = self._r.get(name)
        if data is None:
            raise ChunkMissing(f"chunk {key} level {level} is not in {self._label}")
        return data

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
            lengths = pipe.execute()
        return [n - record.HEADER_SIZE if n else None for n in lengths]

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
                replies = pipe.execute(raise_on_error=False)
            for i, name in enumerate(batch):
                m = ENTRY_RE.match(name.decode() if isinstance(name, bytes) else name)
                length, idle = replies[2 * i], replies[2 * i + 1]
                if not m or not isinstance(length, int) or length == 0:
                    continue  # foreign key, or expired/evicted between SCAN and STRLEN
                last_used = now - idle if isinstance(idle, int) else None
                yield ChunkInfo(m["key"], int(m["level"]), length - record.HEADER_SIZE, last_used)

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

    @property
    def capacity_bytes(self) -> int | None:
        return self.max_memory

    @property
    def label(self) -> str:
        return self._label

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._r.close()


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))
