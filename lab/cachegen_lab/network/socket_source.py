"""``SocketSource``: chunks from a ChunkServer over TCP, verified on this side as a store would.

A connection is pipelined (send many requests, then receive in order) and every wait on it is
bounded by the stall timeout and the load's deadline.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import time
from collections.abc import Callable

from cachegen.store import RecordAddress, record
from cachegen.store.errors import ChunkTooLarge, StoreUnavailable
from cachegen.stream.errors import StreamProtocolError, StreamTimeout
from cachegen.stream.source import (
    DEFAULT_STALL_TIMEOUT_S,
    ChunkConnection,
    ChunkSource,
    ProgressFn,
    ReceivedChunk,
)
from cachegen_lab.network import protocol

DEFAULT_MAX_CHUNK_BYTES = 1 << 30
RECV_BLOCK = 1024 * 1024  # at most per recv: at several Gbit/s, fewer and larger reads


class SocketSource(ChunkSource):
    """Chunks from a ChunkServer at ``address``; ``socket_factory`` makes the socket (netns).

    The server forwards stored records unverified; this side verifies them, with ``secret``
    (bytes, str, or a store's ``record_signer``; None: ``CACHEGEN_STORE_SECRET``) as a store
    opened with that secret would: records not signed with it raise ``ChunkForged``.
    """

    def __init__(
        self,
        address: tuple[str, int],
        *,
        socket_factory: Callable[[], socket.socket] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        secret: bytes | str | record.Signer | None = None,
    ) -> None:
        self.address = address
        self._signer = record.signer_for(secret)
        self.socket_factory = socket_factory or (
            lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        )
        self.max_chunk_bytes = max_chunk_bytes

    def open(
        self, *, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, deadline: float | None = None
    ) -> ChunkConnection:
        sock = self.socket_factory()
        sock.settimeout(stall_timeout_s)
        try:
            sock.connect(self.address)
        except TimeoutError:
            sock.close()
            raise StreamTimeout(
                f"connecting to chunk server {self.address} took over {stall_timeout_s} s"
            ) from None
        except OSError as exc:
            sock.close()
            raise StoreUnavailable(f"cannot connect to chunk server {self.address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _SocketConnection(
            sock, stall_timeout_s, deadline, self.max_chunk_bytes, self._signer
        )


class _SocketConnection(ChunkConnection):
    def __init__(
        self,
        sock: socket.socket,
        stall_s: float,
        deadline: float | None,
        max_bytes: int,
        signer: record.Signer | None = None,
    ) -> None:
        self.sock, self.stall_s, self.deadline, self.max_bytes = sock, stall_s, deadline, max_bytes
        self.signer = signer
        self._pending: collections.deque = collections.deque()  # (request_id, address, t_request)
        self._next_id = 0

    def request(self, address: RecordAddress) -> None:
        request_id = self._next_id
        self._next_id += 1
        frame = protocol.pack_request(request_id, address)
        self._pending.append((request_id, address, time.monotonic()))
        try:
            self.sock.sendall(frame)
        except TimeoutError:
            raise StreamTimeout(f"sending a request stalled for {self.stall_s} s") from None
        except OSError as exc:
            raise StreamProtocolError(f"chunk server closed the connection: {exc}") from exc

    def _recv(self, n: int, what: str) -> bytes:
        self._arm_timeout()
        try:
            return protocol.recv_exact(self.sock, n, what)
        except StreamTimeout:
            self._check_deadline()
            raise

    def _check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise StreamTimeout("the load overran its deadline (timeout_s)") from None

    def _arm_timeout(self) -> None:
        timeout = self.stall_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self._check_deadline()
            timeout = min(timeout, left)
        self.sock.settimeout(timeout)

    def receive(self, on_progress: ProgressFn | None = None) -> ReceivedChunk:
        if not self._pending:
            raise StreamProtocolError("receive() without an outstanding request")
        request_id, address, t_request = self._pending.popleft()
        key = str(address)  # names the record in errors
        try:
            head = self._recv(protocol.RESPONSE.size, f"response header of chunk {key}")
        except OSError as exc:
            raise StreamProtocolError(f"connection to chunk server failed: {exc}") from exc
        magic, rid, status, length = protocol.RESPONSE.unpack(head)
        if magic != protocol.RESPONSE_MAGIC or rid != request_id:
            raise StreamProtocolError(
                f"chunk server sent a malformed or out-of-order response for chunk {key}"
            )
        if status != protocol.OK:
            if length > protocol.MAX_MESSAGE:
                raise StreamProtocolError(f"chunk server sent a {length}-byte error message")
            raise protocol.error_for(
                status, self._recv(length, "error message").decode("utf-8", "replace")
            )
        if length > self.max_bytes:
            raise ChunkTooLarge(
                f"chunk {key}: the record is {length} bytes, over the cap of {self.max_bytes} "
                "(max_record_bytes), so it is refused without reading it; raise the cap if "
                "chunks this large are expected"
            )
        if length < record.HEADER_SIZE:
            raise StreamProtocolError(
                f"chunk {key}: record of {length} bytes is shorter than a record header"
            )
        buf = bytearray(length)
        view = memoryview(buf)
        got = 0
        try:
            while got < length:
                self._arm_timeout()
                try:
                    k = self.sock.recv_into(view[got : got + RECV_BLOCK])
                except TimeoutError:
                    self._check_deadline()
                    raise StreamTimeout(
                        f"chunk {key} stalled after {got} of {length} bytes "
                        f"(no data for {self.sock.gettimeout():.3g} s)"
                    ) from None
                if k == 0:
                    raise StreamProtocolError(
                        f"chunk {key}: connection closed after {got} of {length} bytes"
                    )
                got += k
                if on_progress is not None:
                    on_progress(got, length)
        except OSError as exc:
            raise StreamProtocolError(
                f"chunk {key}: connection failed after {got} of {length} bytes: {exc}"
            ) from exc
        t_last = time.monotonic()
        del view
        payload = record.unpack_at(buf, address, self.signer)
        return ReceivedChunk(address, payload, t_request, t_last)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
