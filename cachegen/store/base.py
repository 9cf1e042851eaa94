"""The chunk-store interface shared by every backend, and helpers built on it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass

from cachegen.errors import CacheGenError
from cachegen.modes import Form
from cachegen.store import record
from cachegen.store.address import RecordAddress, locate
from cachegen.store.errors import ChunkTooLarge, StoreConfigError, StoreError
from cachegen.store.profile_records import ProfileRecords


@dataclass(frozen=True)
class ChunkInfo:
    """One stored record as a backend lists it: its key, its slot (``level``; the form it
    holds is :meth:`ChunkStore.form_of`), payload size in bytes and last use (Unix seconds, or
    None)."""

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


HEADER_READ = 4096  # bytes of a payload that hold a bitstream's header


class ChunkStore(ProfileRecords, ABC):
    """Encoded chunks, each record named by a :class:`RecordAddress` (its chunk, part and
    form). Callers use the address methods (:meth:`read`, :meth:`write`, :meth:`holds`,
    :meth:`payload_sizes`, :meth:`remove`); the ``(key, level)`` methods are what a backend
    implements, its level being the address's private slot (``cachegen.store.address``).

    Readers never see a partial chunk: ``get`` returns a payload verified against the
    checksum written with it, or raises ``ChunkMissing`` / ``ChunkCorrupt`` /
    ``StoreUnavailable``. Stores are safe to share between threads.

    A store opened with a secret signs every record it writes (record format version 2) and
    refuses, with ``ChunkForged``, any record not signed with that secret for that key and
    level. ``max_record_bytes`` bounds the records it writes and reads (``ChunkTooLarge``).
    Next to the chunks it keeps the codec's profile records (:class:`ProfileRecords`).
    """

    url: str
    max_record_bytes: int | None = None
    _signer: record.Signer | None = None

    def _init_records(self, secret, max_record_bytes: int | None) -> None:
        """Backends call this first: the secret (None: ``CACHEGEN_STORE_SECRET``) and cap."""
        if max_record_bytes is not None and max_record_bytes < record.HEADER_SIZE_SIGNED:
            raise StoreConfigError(
                f"max_record_bytes must be at least {record.HEADER_SIZE_SIGNED} (a record "
                f"header), got {max_record_bytes}"
            )
        self.max_record_bytes = max_record_bytes
        self._signer = record.signer_for(secret)

    @property
    def signed(self) -> bool:
        """Whether this store signs its records and accepts only records signed with its secret."""
        return self._signer is not None

    @property
    def record_signer(self) -> record.Signer | None:
        """What verifies this store's records elsewhere (``SocketSource(..., secret=...)``)."""
        return self._signer

    @property
    def label(self) -> str:
        """The URL without secrets, for messages and reports."""
        return self.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r}, signed={self.signed})"

    def _pack(self, key: str, level: int, blob: bytes) -> bytes:
        """The record to store for ``blob`` (signed if this store has a secret), size-checked."""
        self._check_record_size(
            key, level, record.record_size(len(blob), self.signed), writing=True
        )
        return record.pack(key, level, blob, self._signer)

    def _check_record_size(self, key: str, level: int, size: int, *, writing: bool = False) -> None:
        cap = self.max_record_bytes
        if cap is None or size <= cap:
            return
        what = "not stored" if writing else "refused without reading it"
        raise ChunkTooLarge(
            f"chunk {key} level {level} in {self.label}: the record is {size} bytes, over this "
            f"store's max_record_bytes of {cap}, so it is {what}; raise the store option "
            "max_record_bytes (URL ?max_record_bytes=SIZE or open_store(..., "
            "max_record_bytes=...)) if chunks this large are expected"
        )

    # ---- records by address ---------------------------------------------------------------

    def read(self, address: RecordAddress) -> bytes:
        """The verified payload of the record at ``address``."""
        return self.get(*locate(address))

    def read_many(self, addresses: Sequence[RecordAddress]) -> list[bytes | StoreError]:
        """The verified payloads at ``addresses``, in order (see ``get_records``)."""
        return self.get_many([locate(a) for a in addresses])

    def read_records(self, addresses: Sequence[RecordAddress]) -> list[bytes | StoreError]:
        """The stored records (header + payload) at ``addresses``, unverified, in order: for
        forwarding to a remote reader, who checks each with ``record.unpack_at``."""
        return self.get_records([locate(a) for a in addresses])

    def read_listed(self, entries: Sequence[ChunkInfo]) -> list[bytes | StoreError]:
        """The verified payloads of records as :meth:`list` gave them, in order (see
        ``get_records``): for tools that walk a store's listing."""
        return self.get_many([(entry.key, entry.level) for entry in entries])

    def record_start(self, entry: ChunkInfo, length: int = HEADER_READ) -> bytes:
        """The first ``length`` bytes of ``entry``'s payload (all of a shorter one), read
        without the checksum that covers the whole payload."""
        stream = self.get_stream(entry.key, entry.level, block_size=length)
        try:
            return next(stream, b"")
        finally:
            stream.close()

    def form_of(self, entry: ChunkInfo) -> Form | None:
        """The form a listed record holds, from its bitstream header (None: not a bitstream,
        or removed since the listing)."""
        from cachegen.codec import form_of  # the codec loads numba: only when asked

        try:
            return form_of(self.record_start(entry))
        except CacheGenError:
            return None

    def write(self, address: RecordAddress, blob: bytes) -> None:
        """Store ``blob`` at ``address`` (replacing any previous one) atomically."""
        self.put(*locate(address), blob)

    def holds(self, addresses: Sequence[RecordAddress]) -> list[bool]:
        """For each address, whether its record is stored (a round trip per form)."""
        return self._per_slot(addresses, self.exists_many)

    def payload_sizes(self, addresses: Sequence[RecordAddress]) -> list[int | None]:
        """Payload bytes of each address's record (None where missing)."""
        return self._per_slot(addresses, self.sizes)

    def remove(self, address: RecordAddress) -> int:
        """Delete the record at ``address``; returns the records removed (0 or 1)."""
        return self.delete(*locate(address))

    def _per_slot(self, addresses: Sequence[RecordAddress], ask) -> list:
        """``ask(keys, slot)`` once per slot among ``addresses``, answers in their order."""
        located = [locate(a) for a in addresses]
        by_slot: dict[int, list[int]] = {}
        for i, (_, slot) in enumerate(located):
            by_slot.setdefault(slot, []).append(i)
        out: list = [None] * len(located)
        for slot, indices in by_slot.items():
            for i, answer in zip(indices, ask([located[i][0] for i in indices], slot)):
                out[i] = answer
        return out

    # ---- what a backend implements ------------------------------------------------------

    @abstractmethod
    def put(self, key: str, level: int, blob: bytes) -> None:
        """Store ``blob`` (replacing any previous one) atomically."""

    @abstractmethod
    def get_record(self, key: str, level: int) -> bytes:
        """The stored record (header + payload) unverified, for forwarding to a remote reader.

        A record over ``max_record_bytes`` raises ``ChunkTooLarge`` before it is read whole.
        """

    def get(self, key: str, level: int) -> bytes:
        """The verified payload of ``(key, level)``."""
        return record.unpack(self.get_record(key, level), key, level, self._signer)

    def get_records(self, items: Sequence[tuple[str, int]]) -> list[bytes | StoreError]:
        """The stored records of several ``(key, level)`` pairs, unverified, in order.

        Each pair that cannot be read holds the ``StoreError`` that ``get_record`` would have
        raised for it, so one missing chunk does not hide the others. Backends with round
        trips fetch them in one (a pipeline); this default reads them one by one.
        """
        out: list[bytes | StoreError] = []
        for key, level in items:
            try:
                out.append(self.get_record(key, level))
            except StoreError as exc:
                out.append(exc)
        return out

    def get_many(self, items: Sequence[tuple[str, int]]) -> list[bytes | StoreError]:
        """The verified payloads of several ``(key, level)`` pairs (see ``get_records``)."""
        out: list[bytes | StoreError] = []
        for (key, level), found in zip(items, self.get_records(items)):
            if not isinstance(found, StoreError):
                try:
                    found = record.unpack(found, key, level, self._signer)
                except StoreError as exc:
                    found = exc
            out.append(found)
        return out

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

        return record.iter_payload(
            read, key, level, block_size, self._signer, self._size_check(key, level)
        )

    def _size_check(self, key: str, level: int):
        if self.max_record_bytes is None:
            return None
        return lambda size: self._check_record_size(key, level, size)

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


def lru_victims(entries: Iterable[ChunkInfo], max_bytes: int) -> tuple[list[ChunkInfo], int]:
    """The least recently used ``entries`` to remove so that at most ``max_bytes`` of payload
    remain, oldest first, and the payload bytes left after removing them."""
    if max_bytes < 0:
        raise StoreConfigError(f"max_bytes must be >= 0, got {max_bytes}")
    by_age = sorted(entries, key=lambda e: e.last_used or 0.0)
    total = sum(e.size for e in by_age)
    victims: list[ChunkInfo] = []
    for entry in by_age:
        if total <= max_bytes:
            break
        victims.append(entry)
        total -= entry.size
    return victims, total


def stored_prefix(store: ChunkStore, chunks: Sequence[Sequence[RecordAddress]]) -> int:
    """How many leading ``chunks`` (each the addresses of the records it needs) are stored in
    full: with chained keys, the longest stored prefix of their token sequence, in chunks."""
    flat = [address for needed in chunks for address in needed]
    held = iter(store.holds(flat))
    for i, needed in enumerate(chunks):
        if not all([next(held) for _ in needed]):
            return i
    return len(chunks)
