"""The chunk protocol spoken over TCP between a loader and a ChunkServer.

Request (client -> server), one per chunk, any number in flight:
    "CGRQ" | request id u32 | level u16 | key length u16 | key (ASCII)
Response (server -> client), in request order:
    "CGRS" | request id u32 | status u8 | body length u64 | body
The body of an OK response is the chunk's stored record (record.py: header with length,
key digest and SHA-256, then the payload), which the client verifies; any other status
carries a UTF-8 message. All integers are little-endian.
"""

from __future__ import annotations

import socket
import struct

from cachegen.store.errors import ChunkCorrupt, ChunkMissing, StoreError, StoreUnavailable
from cachegen.stream.errors import StreamProtocolError, StreamTimeout

REQUEST = struct.Struct("<4sIHH")
RESPONSE = struct.Struct("<4sIBQ")
REQUEST_MAGIC = b"CGRQ"
RESPONSE_MAGIC = b"CGRS"
MAX_KEY = 1024
MAX_MESSAGE = 64 * 1024

OK, MISSING, UNAVAILABLE, CORRUPT, ERROR = range(5)
_ERROR_TYPES = {
    MISSING: ChunkMissing,
    UNAVAILABLE: StoreUnavailable,
    CORRUPT: ChunkCorrupt,
    ERROR: StoreError,
}


def status_of(exc: StoreError) -> int:
    for status, kind in _ERROR_TYPES.items():
        if kind is not StoreError and isinstance(exc, kind):
            return status
    return ERROR


def error_for(status: int, message: str) -> StoreError:
    kind = _ERROR_TYPES.get(status)
    if kind is None:
        raise StreamProtocolError(f"chunk server sent unknown status {status}")
    return kind(f"chunk server: {message}")


def pack_request(request_id: int, key: str, level: int) -> bytes:
    raw = key.encode("ascii")
    return REQUEST.pack(REQUEST_MAGIC, request_id, level, len(raw)) + raw


def pack_response_header(request_id: int, status: int, length: int) -> bytes:
    return RESPONSE.pack(RESPONSE_MAGIC, request_id, status, length)


def recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    """Exactly ``n`` bytes, or StreamTimeout (socket timeout) / StreamProtocolError (EOF)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            raise StreamTimeout(
                f"no bytes for {sock.gettimeout():.3g} s while reading {what}"
            ) from None
        if k == 0:
            raise StreamProtocolError(f"connection closed after {got} of {n} bytes of {what}")
        got += k
    return bytes(buf)
