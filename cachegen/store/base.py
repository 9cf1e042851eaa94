"""The chunk-store interface shared by every backend, and helpers built on it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

from cachegen.store import record


@dataclass(frozen=True)
class ChunkInfo:
    """One stored (key, level): payload size in bytes and last use (Unix seconds, or None)."""

    key: str
    level: int
    size: int
    last_used: float | None = None


@dataclass(frozen=True)
class StoreStats:
    url: str
    chunks: int  # distinct keys
    entries: int  # (key, level) pairs
    payload_bytes: int
    capacity_bytes: int | None
    namespaces: dict[str, int]  # namespace -> entries

    def to_dict(self) -> dict:
        return asdict(self)


class ChunkStore(ABC):
    """Encoded chunks addressed by ``(key, level)``; keys come from :func:`chunk_keys`.

    Readers never see a partial chunk: ``get`` returns a payload verified against the
    checksum written with it, or raises ``ChunkMissing`` / ``ChunkCorrupt`` /
    ``StoreUnavailable``. Stores are safe to share between threads.
    """

    url: str

    @property
    def label(self) -> str:
        """The URL without secrets, for messages and reports."""
        return self.url

    @abstractmethod
    def put(self, key: str, level: int, blob: bytes) -> None:
        """Store ``blob`` (replacing any previous one) atomically."""

    @abstractmethod
    def get_record(self, key: str, level: int) -> bytes:
        """The stored record (header + payload) unverified, for forwarding to a remote reader."""

    def get(self, key: str, level: int) -> bytes:
        """The verified payload of ``(key, level)``."""
        return record.unpack(self.get_record(key, level), key, level)

    def get_stream(self, key: str, level: int, block_size: int = 1 << 20) -> Iterator[bytes]:
        """The verified payload in blocks of at most ``block_size`` bytes.

        Blocks are provisional until the iterator ends: a damaged payload raises
        ``ChunkCorrupt`` after its last block. Backends read byte ranges via ``_read_range``.
        """
        offset = 0

        def read(n: int) -> bytes:
            nonlocal offset
            data = self._read_range(key, level, offset, n)
            offset += len(data)
            return data

        return record.iter_payload(read, key, level, block_size)

    def _read_range(self, key: str, level: int, offset: int, length: int) -> bytes:
        return self.get_record(key, level)[offset : offset + length]

    @abstractmethod
    def exists_many(self, keys: Sequence[str], level: int) -> list[bool]:
        """For each key, whether it is stored at ``level`` (one round trip where possible)."""

    def exists(self, key: str, level: int) -> bool:
        return self.exists_many([key], level)[0]

    @abstractmethod
    def levels(self, key: str) -> list[int]:
        """Levels stored for ``key``, ascending."""

    @abstractmethod
    def sizes(self, keys: Sequence[str], level: int) -> list[int | None]:
        """Payload bytes of each key at ``level`` (None where missing)."""

    @abstractmethod
    def delete(self, key: str, level: int | None = None) -> int:
        """Remove one level (or all levels) of ``key``; returns entries removed."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ChunkInfo]:
        """Every stored entry whose key starts with ``prefix``."""

    @abstractmethod
    def evict(self, max_bytes: int) -> int:
        """Remove least recently used entries until at most ``max_bytes`` of payload remain.

        Returns the number of entries removed; ``evict(0)`` empties the store.
        """

    @property
    def capacity_bytes(self) -> int | None:
        return None

    def stats(self) -> StoreStats:
        keys: set[str] = set()
        namespaces: dict[str, int] = {}
        entries = total = 0
        for info in self.list():
            keys.add(info.key)
            entries += 1
            total += info.size
            ns = info.key.split("/", 1)[0]
            namespaces[ns] = namespaces.get(ns, 0) + 1
        return StoreStats(self.label, len(keys), entries, total, self.capacity_bytes, namespaces)

    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def longest_prefix(store: ChunkStore, keys: Sequence[str], levels: int | Sequence[int]) -> int:
    """How many leading ``keys`` are stored at every one of ``levels``.

    Keys are chained hashes, so this is the length (in chunks) of the longest stored prefix
    of the token sequence the keys were derived from.
    """
    wanted = [levels] if isinstance(levels, int) else list(levels)
    present = [True] * len(keys)
    for level in wanted:
        present = [a and b for a, b in zip(present, store.exists_many(keys, level))]
    for i, ok in enumerate(present):
        if not ok:
            return i
    return len(keys)
