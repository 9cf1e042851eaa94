"""The local-directory chunk store (the embedded default).

Layout under the root directory::

    cachegen-store.json               marker: format name and version
    chunks/<namespace>/<digest>/L<level>.cgc   one record (see record.py) per (key, level)
    tables/<tables id>.cgc            profile tables the chunks need (one record each)
    model-files/<file id>.cgc         model files the chunks need (tcq models, kvtc bases)
    profiles/<profile id>.cgc         codec profile documents (one record each)
    adopted/<fingerprint>-<codec>.cgc the profile adopted for a model and codec (written once)
    tmp/                              records being written
    usage.json                        the chunks' payload bytes, while a writer bounds the store
    .lock                             taken while evicting and while counting the bytes

Writes go to ``tmp/`` and are renamed into place, so a reader opens either the old or the
new complete file, never a partial one; a reader whose file is evicted meanwhile still
reads it whole (the inode lives until closed). Reads bump the file's mtime, which is the
LRU clock for eviction when ``max_bytes`` bounds the store.

``max_bytes`` bounds the directory, whoever writes it: every writer of the directory (other
processes, other store objects) counts what it stores and removes in ``usage.json``, under
``.lock``, so the bound holds for all of them together. The count starts from the directory's
contents when the file is missing or unreadable, and each eviction sets it from them again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from cachegen.errors import InputError
from cachegen.fileio import check_version, versioned, write_atomic
from cachegen.store import record
from cachegen.store.base import ChunkInfo, ChunkStore, lru_victims
from cachegen.store.errors import ChunkMissing, StoreConfigError, StoreError
from cachegen.store.keys import validate_key, validate_level
from cachegen.store.profile_records import describe, record_too_large

MARKER = "cachegen-store.json"
SCHEMA = "cachegen-chunk-store"
VERSION = 1
SUFFIX = ".cgc"
STALE_TMP_S = 3600
EVICT_TO = 0.9  # after an over-capacity put, evict down to this fraction of max_bytes
USAGE = "usage.json"
USAGE_SCHEMA = "cachegen-store-usage"
USAGE_VERSION = 1


class LocalStore(ChunkStore):
    def __init__(
        self,
        root: str | os.PathLike,
        *,
        max_bytes: int | None = None,
        fsync: bool = False,
        secret: bytes | str | None = None,
        max_record_bytes: int | None = None,
    ) -> None:
        """``secret``: sign and verify records (None: ``CACHEGEN_STORE_SECRET``, empty: none);
        ``max_record_bytes``: the largest record (header + payload) written or read."""
        self._init_records(secret, max_record_bytes)
        self.root = Path(root).expanduser().absolute()
        self.url = self.root.as_uri()
        if max_bytes is not None and max_bytes <= 0:
            raise StoreConfigError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.fsync = fsync
        self._chunks = self.root / "chunks"
        self._tmp = self.root / "tmp"
        self._usage = self.root / USAGE
        self._lock_path = self.root / ".lock"
        self._init_root()

    def _init_root(self) -> None:
        marker = self.root / MARKER
        try:
            if self.root.exists() and not marker.exists() and self._foreign_entries():
                raise StoreConfigError(
                    f"{self.root} is a non-empty directory that is not a cachegen chunk store; "
                    "choose another path"
                )
            self._chunks.mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(exist_ok=True)
            if not marker.exists():
                tmp = self._tmp / f"{uuid.uuid4().hex}.json"
                tmp.write_text(json.dumps(versioned(SCHEMA, VERSION, {})) + "\n")
                os.replace(tmp, marker)
            meta = json.loads(marker.read_text())
        except OSError as exc:
            raise StoreConfigError(f"cannot use {self.root} as a chunk store: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise StoreConfigError(
                f"{marker} is damaged ({exc}); remove the directory or pick another"
            ) from exc
        if meta.get("format") == SCHEMA:  # stores made before markers said "schema"
            meta = {"schema": SCHEMA, "version": meta.get("version")}
        try:
            check_version(meta, SCHEMA, (VERSION,), str(marker))
        except InputError as exc:
            raise StoreConfigError(
                f"{self.root} is not a store this cachegen reads: {exc}"
            ) from exc
        now = time.time()
        for leftover in self._tmp.iterdir():  # writers that died mid-write
            with contextlib.suppress(OSError):
                if now - leftover.stat().st_mtime > STALE_TMP_S:
                    leftover.unlink()

    def _foreign_entries(self) -> list[Path]:
        """What the root holds besides a store's own layout, before its marker is written:
        another process may be creating the same store (every TP rank opens it at start-up),
        and until its marker lands its directories are all there is."""
        own = {self._chunks, self._tmp}
        return [entry for entry in self.root.iterdir() if entry not in own]

    def _path(self, key: str, level: int) -> Path:
        return self._chunks / validate_key(key) / f"L{validate_level(level)}{SUFFIX}"

    # ---- writing ---------------------------------------------------------------------

    def put(self, key: str, level: int, blob: bytes) -> None:
        path = self._path(key, level)
        if self.max_bytes is not None and len(blob) > self.max_bytes:
            raise StoreError(
                f"chunk of {len(blob)} bytes exceeds the store capacity of {self.max_bytes} bytes"
            )
        data = self._pack(key, level, blob)
        tmp = self._tmp / f"{uuid.uuid4().hex}{SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            if not self._counted():
                _rename_into_place(tmp, path)
                return
            with _file_lock(self._lock_path):  # the rename and the count, as one step
                used = self._read_usage()
                replaced = _payload_size(path)
                _rename_into_place(tmp, path)
                if used is not None:
                    used += len(blob) - (replaced[0] if replaced else 0)
                used = self._write_usage(used)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreError(
                f"cannot write chunk {key} level {level} under {self.root}: {exc}"
            ) from exc
        if self.max_bytes is not None and used > self.max_bytes:
            self.evict(int(self.max_bytes * EVICT_TO))

    # ---- reading ---------------------------------------------------------------------

    def get_record(self, key: str, level: int) -> bytes:
        path = self._path(key, level)
        cap = self.max_record_bytes
        try:
            with open(path, "rb") as f:
                if cap is None:
                    data = f.read()
                else:  # never more than the cap in memory, whatever the file claims
                    self._check_record_size(key, level, os.fstat(f.fileno()).st_size)
                    data = f.read(cap + 1)
                    self._check_record_size(key, level, len(data))
        except FileNotFoundError:
            raise ChunkMissing(f"chunk {key} level {level} is not in {self.url}") from None
        except OSError as exc:
            raise StoreError(f"cannot read chunk {key} level {level}: {exc}") from exc
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU clock
        return data

    def get_stream(self, key: str, level: int, block_size: int = 1 << 20) -> Iterator[bytes]:
        # One open file for the whole read, so a concurrent replace cannot mix two versions.
        path = self._path(key, level)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise ChunkMissing(f"chunk {key} level {level} is not in {self.url}") from None
        with f:
            check = self._size_check(key, level)
            if check is not None:
                check(os.fstat(f.fileno()).st_size)
            yield from record.iter_payload(f.read, key, level, block_size, self._signer, check)

    def exists_many(self, keys: Sequence[str], level: int) -> list[bool]:
        return [self._path(k, level).is_file() for k in keys]

    def levels(self, key: str) -> list[int]:
        directory = self._chunks / validate_key(key)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        return sorted(
            int(n[1 : -len(SUFFIX)]) for n in names if n.startswith("L") and n.endswith(SUFFIX)
        )

    def sizes(self, keys: Sequence[str], level: int) -> list[int | None]:
        out: list[int | None] = []
        for key in keys:
            found = _payload_size(self._path(key, level))
            out.append(None if found is None else found[0])
        return out

    def list(self, prefix: str = "") -> Iterator[ChunkInfo]:
        for ns_dir in sorted(self._chunks.iterdir()):
            for chunk_dir in sorted(_listdir(ns_dir)):
                key = f"{ns_dir.name}/{chunk_dir.name}"
                if not key.startswith(prefix):
                    continue
                for entry in sorted(_listdir(chunk_dir)):
                    if not (entry.name.startswith("L") and entry.name.endswith(SUFFIX)):
                        continue
                    found = _payload_size(entry)
                    if found is None:
                        continue
                    level = int(entry.name[1 : -len(SUFFIX)])
                    yield ChunkInfo(key, level, *found)

    # ---- profile tables, model files, codec profiles and adopted pointers -----------

    def _meta_path(self, kind: str, name: str) -> Path:
        return self.root / kind / f"{name}{SUFFIX}"

    def _read_meta(self, kind: str, name: str, cap: int) -> bytes | None:
        try:
            with open(self._meta_path(kind, name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > cap:
                    raise record_too_large(kind, name, size, cap)
                return f.read(cap + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {describe(kind, name)}: {exc}") from exc

    def _write_meta(self, kind: str, name: str, data: bytes, *, exclusive: bool) -> bool:
        path = self._meta_path(kind, name)
        tmp = self._tmp / f"{uuid.uuid4().hex}{SUFFIX}"
        try:
            path.parent.mkdir(exist_ok=True)
            tmp.write_bytes(data)
            if not exclusive:
                os.replace(tmp, path)
                return True
            try:
                os.link(tmp, path)  # atomic, and fails when another writer was first
            except FileExistsError:
                return False
            return True
        except OSError as exc:
            raise StoreError(
                f"cannot write {describe(kind, name)} under {self.root}: {exc}"
            ) from exc
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _holds_meta(self, records: Sequence[tuple[str, str]]) -> list[bool]:
        return [self._meta_path(kind, name).is_file() for kind, name in records]

    def _delete_meta(self, kind: str, name: str) -> bool:
        try:
            self._meta_path(kind, name).unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot delete {describe(kind, name)}: {exc}") from exc
        return True

    def _list_meta(self, kind: str) -> list[str]:
        try:
            entries = list((self.root / kind).iterdir())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreError(f"cannot list {kind} under {self.root}: {exc}") from exc
        return [e.name[: -len(SUFFIX)] for e in entries if e.name.endswith(SUFFIX)]

    # ---- removal ---------------------------------------------------------------------

    def delete(self, key: str, level: int | None = None) -> int:
        paths = [self._path(key, lv) for lv in (self.levels(key) if level is None else [level])]
        if not self._counted():
            removed = sum(_unlink(path) is not None for path in paths)
        else:
            with _file_lock(self._lock_path):
                used = self._read_usage()
                sizes = [size for size in map(_unlink, paths) if size is not None]
                self._write_usage(None if used is None else used - sum(sizes))
            removed = len(sizes)
        _prune_empty(self._chunks / validate_key(key), self._chunks)
        return removed

    def evict(self, max_bytes: int) -> int:
        with _file_lock(self._lock_path):
            victims, remaining = lru_victims(self.list(), max_bytes)
            removed = 0
            for entry in victims:
                removed += _unlink(self._path(entry.key, entry.level)) is not None
                _prune_empty(self._chunks / entry.key, self._chunks)
            if self._counted():
                self._write_usage(remaining)
        return removed

    @property
    def capacity_bytes(self) -> int | None:
        return self.max_bytes

    # ---- the shared count of stored bytes (callers hold the lock) ---------------------

    def _counted(self) -> bool:
        """Whether writes are counted: this store is bounded, or another writer bounds it."""
        return self.max_bytes is not None or self._usage.exists()

    def _read_usage(self) -> int | None:
        """The payload bytes stored, as counted; None when there is no valid count."""
        try:
            doc = json.loads(self._usage.read_text())
            doc = check_version(doc, USAGE_SCHEMA, (USAGE_VERSION,), str(self._usage))
            used = doc["payload_bytes"]
        except (OSError, ValueError, KeyError, TypeError, InputError):
            return None
        return used if isinstance(used, int) and used >= 0 else None

    def _write_usage(self, used: int | None) -> int:
        """Record ``used`` payload bytes (None: count the directory's chunks afresh); returns
        the bytes recorded."""
        used = sum(e.size for e in self.list()) if used is None else max(0, used)
        doc = versioned(USAGE_SCHEMA, USAGE_VERSION, {"payload_bytes": used})
        write_atomic(self._usage, (json.dumps(doc) + "\n").encode())
        return used


def _payload_size(path: Path) -> tuple[int, float] | None:
    """(payload bytes, mtime) of the record file at ``path``, or None if it is gone.

    The header's format version says how long the header is (signed records have a longer
    one), so the first bytes are read; the mtime is untouched (it is the LRU clock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        head = os.pread(fd, 8, 0)
    finally:
        os.close(fd)
    return record.payload_size(head, st.st_size), st.st_mtime


def _rename_into_place(tmp: Path, path: Path) -> None:
    for attempt in range(3):  # an evictor may remove the empty parent between mkdir and rename
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, path)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise


def _unlink(path: Path) -> int | None:
    """Remove the record file at ``path``; its payload bytes, or None if it was gone."""
    found = _payload_size(path)
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    return found[0] if found else 0


def _listdir(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir()]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _prune_empty(directory: Path, stop: Path) -> None:
    """Remove ``directory`` and its parents up to ``stop`` while they are empty."""
    while directory != stop and stop in directory.parents:
        try:
            directory.rmdir()
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                return
            raise
        directory = directory.parent


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
