"""Where a loader gets chunks: ``ChunkSource``, and ``DirectSource`` (straight from a store).

A source gives a connection with ``request(address)`` (a ``cachegen.store.RecordAddress``;
pipelined: send many, then receive in order) and ``receive(on_progress) -> ReceivedChunk``
(a verified payload, or a typed error).
"""

from __future__ import annotations

import collections
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from cachegen.errors import InputError
from cachegen.store.address import RecordAddress
from cachegen.store.base import ChunkStore
from cachegen.store.errors import StoreError
from cachegen.stream.errors import StreamProtocolError, StreamTimeout

DEFAULT_STALL_TIMEOUT_S = 5.0
DIRECT_PREFETCH = 4
FETCH_BATCH_BYTES = 1024 * 1024  # records of about this many bytes per store round trip

ProgressFn = Callable[[int, int], None]  # (bytes received of this chunk, total)


@dataclass
class ReceivedChunk:
    address: RecordAddress
    payload: bytes
    t_request: float  # monotonic time the request was sent
    t_last: float  # last byte of the response

    @property
    def nbytes(self) -> int:
        return len(self.payload)


class ChunkConnection(ABC):
    @abstractmethod
    def request(self, address: RecordAddress) -> None: ...

    @abstractmethod
    def receive(self, on_progress: ProgressFn | None = None) -> ReceivedChunk: ...

    def close(self) -> None:
        """Abort: in-flight requests are dropped; safe to call from another thread."""


class ChunkSource(ABC):
    @abstractmethod
    def open(
        self, *, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, deadline: float | None = None
    ) -> ChunkConnection:
        """A new connection; ``deadline`` (monotonic) bounds every wait on it."""


class DirectSource(ChunkSource):
    """Chunks read from ``store`` in the loader's fetch thread: no socket, no shaping.

    Reads run ahead of ``receive``: after the first chunk (read alone, so the decoder starts
    on it soonest), up to ``prefetch`` requested chunks of about ``FETCH_BATCH_BYTES`` in all
    are read per store round trip (``ChunkStore.read_many``), so a remote store's latency is
    paid once per batch of small chunks; large ones are read one by one, as a batch arrives
    whole.
    """

    def __init__(self, store: ChunkStore, *, prefetch: int = DIRECT_PREFETCH) -> None:
        if prefetch < 1:
            raise InputError(f"prefetch must be >= 1, got {prefetch}")
        self.store = store
        self.prefetch = prefetch

    def open(
        self, *, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, deadline: float | None = None
    ) -> ChunkConnection:
        return _DirectConnection(self.store, self.prefetch, deadline)


class _DirectConnection(ChunkConnection):
    """Reads in the caller's thread; past ``deadline`` (monotonic) it reads nothing more: a
    read already waiting on the store ends at the store's own timeout."""

    def __init__(self, store: ChunkStore, prefetch: int, deadline: float | None) -> None:
        self.store = store
        self.prefetch = prefetch
        self.deadline = deadline
        self._pending: collections.deque = collections.deque()  # (address, t_request)
        self._read: collections.deque = collections.deque()  # payload or StoreError, in order
        self._largest = 0  # the largest payload read so far; none yet: read one chunk

    def request(self, address: RecordAddress) -> None:
        self._pending.append((address, time.monotonic()))

    def receive(self, on_progress: ProgressFn | None = None) -> ReceivedChunk:
        if not self._pending:
            raise StreamProtocolError("receive() without an outstanding request")
        if not self._read:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise StreamTimeout("the load overran its deadline before the store answered")
            self._read_ahead()
        address, t_request = self._pending.popleft()
        payload = self._read.popleft()
        if isinstance(payload, StoreError):
            raise payload
        if on_progress is not None:
            on_progress(len(payload), len(payload))
        return ReceivedChunk(address, payload, t_request, time.monotonic())

    def _read_ahead(self) -> None:
        batch = 1
        if self._largest:
            batch = min(self.prefetch, max(1, FETCH_BATCH_BYTES // self._largest))
        ahead = list(itertools.islice(self._pending, batch))
        found = self.store.read_many([address for address, _ in ahead])
        self._read.extend(found)
        sizes = [len(x) for x in found if not isinstance(x, StoreError)]
        self._largest = max([self._largest, *sizes])
