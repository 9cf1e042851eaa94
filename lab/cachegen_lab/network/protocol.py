"""The chunk protocol spoken over TCP between a loader and a ChunkServer.

Request (client -> server), one per record, any number in flight:
    "CGRQ" | request id u32 | key length u16 | part length u8 | form length u8
           | chunk key | part | form (ASCII)
naming the record by its address (``cachegen.store.RecordAddress``): the chunk's key, its part
(empty: the whole chunk; ``full`` or ``sliding``) and its form's name (``cachegen-11-packed``,
``int8``...); the server rebuilds the address with ``RecordAddress.of``.
Response (server -> client), in request order:
    "CGRS" | request id u32 | status u8 | body length u64 | body
The body of an OK response is the record as stored (record.py: header with length, key
digest and SHA-256, then the payload), which the client verifies; any other status carries a
UTF-8 message. All integers are little-endian.
"""

from __future__ import annotations

import socket
import struct

from cachegen.store import RecordAddress
from cachegen.store.errors import ChunkCorrupt, ChunkMissing, StoreError, StoreUnavailable
from cachegen.stream.errors import StreamProtocolError, StreamTimeout

REQUEST = struct.Struct("<4sIHBB")
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


def pack_request(request_id: int, address: RecordAddress) -> bytes:
    key, part, form = (
        address.chunk_key.encode("ascii"),
        (address.part or "").encode("ascii"),
        address.form.label.encode("ascii"),
    )
    head = REQUEST.pack(REQUEST_MAGIC, request_id, len(key), len(part), len(form))
    return head + key + part + form


def unpack_address(key: bytes, part: bytes, form: bytes) -> RecordAddress:
    """The address a request names (``StoreConfigError`` / ``InputError`` if it names none)."""
    text = [raw.decode("ascii", "replace") for raw in (key, part, form)]
    return RecordAddress.of(text[0], text[2], text[1] or None)


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
