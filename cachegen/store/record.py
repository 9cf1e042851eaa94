"""The stored (and transmitted) form of one chunk: a header plus the payload.

Version 1 (unsigned: what a store without a secret writes), a 64-byte header::

    offset size field
         0    4 magic b"CGCK"
         4    1 format version (1)
         5    1 reserved (0)
         6    2 quality level, uint16 little-endian
         8    8 payload length in bytes, uint64 little-endian
        16   32 SHA-256 of the payload
        48   16 first 16 bytes of SHA-256(key), binding the record to its key
        64    - payload

Version 2 (signed: what a store opened with a secret writes), a 96-byte header: the 64 bytes
above with format version 2, then::

        64   32 HMAC-SHA256(secret, bytes 0..63 of the header
                            || key length in bytes, uint16 little-endian || key (UTF-8)
                            || quality level, uint16 little-endian
                            || payload)
        96    - payload

The MAC covers the header (length, checksum, level, key digest), the whole chunk key and the
level (so a signed record cannot be replayed under another key or level) and the payload
(so its bytes cannot be changed even with a recomputed SHA-256). A reader with the secret
accepts only version-2 records whose MAC matches (``ChunkForged`` otherwise); a reader
without one checks everything but the MAC, so it still reads signed records.

The same bytes are what a store holds and what the chunk server sends, so a reader can
verify end to end that it received the chunk it asked for, complete and unaltered.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cachegen.store.address import RecordAddress, locate
from cachegen.store.errors import ChunkCorrupt, ChunkForged, StoreConfigError

MAGIC = b"CGCK"
VERSION = 1  # unsigned records
VERSION_SIGNED = 2
VERSIONS = (VERSION, VERSION_SIGNED)
HEADER = struct.Struct("<4sBBHQ32s16s")
HEADER_SIZE = HEADER.size  # 64: the version-1 header, and the fixed part of every header
MAC_SIZE = 32
HEADER_SIZE_SIGNED = HEADER_SIZE + MAC_SIZE  # 96
SECRET_ENV = "CACHEGEN_STORE_SECRET"
_U16 = struct.Struct("<H")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()[:16]


def header_size(version: int) -> int:
    """Bytes before the payload in a record of format ``version``."""
    return HEADER_SIZE_SIGNED if version == VERSION_SIGNED else HEADER_SIZE


def record_size(payload_len: int, signed: bool) -> int:
    return payload_len + (HEADER_SIZE_SIGNED if signed else HEADER_SIZE)


def payload_size(head: bytes, total: int) -> int:
    """Payload bytes of a ``total``-byte record that starts with ``head`` (at least 5 bytes
    for an exact answer: the format version says how long the header is)."""
    version = head[4] if len(head) > 4 and head[:4] == MAGIC else VERSION
    return max(total - header_size(version), 0)


class Signer:
    """Signs and checks version-2 records with one store secret.

    It holds the HMAC state keyed with the secret, not the secret itself; ``repr`` shows no
    part of it and it cannot be pickled.
    """

    __slots__ = ("_hmac",)

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise StoreConfigError("a store secret must not be empty")
        self._hmac = hmac.new(bytes(secret), digestmod="sha256")

    def start(self, header: bytes | memoryview, key: str, level: int) -> hmac.HMAC:
        """An HMAC over the fixed header, key and level; the caller feeds it the payload."""
        raw = key.encode()
        mac = self._hmac.copy()
        mac.update(bytes(header[:HEADER_SIZE]) + _U16.pack(len(raw)) + raw + _U16.pack(level))
        return mac

    def __repr__(self) -> str:
        return "Signer(secret=<hidden>)"

    def __reduce__(self):
        raise TypeError("a record Signer holds a store secret and cannot be pickled")


MIN_SECRET_BYTES = 16  # 128 bits: shorter secrets can be guessed


def signer_for(secret: bytes | str | Signer | None) -> Signer | None:
    """The signer for ``secret``; None reads ``CACHEGEN_STORE_SECRET``; empty means unsigned."""
    if isinstance(secret, Signer):
        return secret
    if secret is None:
        secret = os.environ.get(SECRET_ENV)
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise StoreConfigError(
            f"the store secret must be bytes or str, not {type(secret).__name__}"
        )
    if not len(secret):
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise StoreConfigError(
            f"the store secret is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} random "
            "bytes (e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return Signer(bytes(secret))


@dataclass(frozen=True)
class RecordHeader:
    level: int
    payload_len: int
    sha256: bytes
    key_digest: bytes
    version: int = VERSION
    mac: bytes | None = None  # version 2, when the bytes given to parse_header included it

    @property
    def size(self) -> int:
        return header_size(self.version)


def pack(
    key: str, level: int, payload: bytes | bytearray | memoryview, signer: Signer | None = None
) -> bytes:
    """The record of ``payload``: version 1 without ``signer``, version 2 (signed) with one."""
    header = HEADER.pack(
        MAGIC,
        VERSION if signer is None else VERSION_SIGNED,
        0,
        level,
        len(payload),
        hashlib.sha256(payload).digest(),
        key_digest(key),
    )
    if signer is None:
        return header + bytes(payload)
    mac = signer.start(header, key, level)
    mac.update(payload)
    return header + mac.digest() + bytes(payload)


def _forged(key: str, level: int, why: str) -> ChunkForged:
    return ChunkForged(
        f"chunk {key} level {level}: {why}: the record was not written with this store's "
        "secret, or it was altered after it was written; it is refused and the load falls back "
        "to recomputing these tokens. Check that every writer of this store uses the same "
        f"secret ({SECRET_ENV} or open_store(..., secret=...)); records written without it "
        "must be written again"
    )


def parse_header(
    data: bytes | memoryview, key: str, level: int, signer: Signer | None = None
) -> RecordHeader:
    """Check the header of a record for ``(key, level)``; the payload is not looked at.

    ``data`` needs the first 64 bytes; the MAC of a version-2 record is returned when ``data``
    holds it too. With ``signer``, an unsigned record or one for another key or level raises
    ``ChunkForged``.
    """
    if len(data) < HEADER_SIZE:
        raise ChunkCorrupt(
            f"chunk {key} level {level}: record is {len(data)} bytes, shorter than its header"
        )
    magic, version, _, rec_level, length, digest, kd = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ChunkCorrupt(f"chunk {key} level {level}: not a cachegen chunk record (bad magic)")
    if version not in VERSIONS:
        raise ChunkCorrupt(
            f"chunk {key} level {level}: record format version {version}, "
            f"this cachegen reads {' and '.join(map(str, VERSIONS))}"
        )
    if signer is not None and version != VERSION_SIGNED:
        raise _forged(key, level, f"the record is unsigned (format version {version})")
    if kd != key_digest(key) or rec_level != level:
        if signer is not None:
            raise _forged(key, level, "the record is signed for another key or level")
        raise ChunkCorrupt(f"chunk {key} level {level}: record belongs to another key or level")
    mac = None
    if version == VERSION_SIGNED and len(data) >= HEADER_SIZE_SIGNED:
        mac = bytes(data[HEADER_SIZE:HEADER_SIZE_SIGNED])
    return RecordHeader(rec_level, length, digest, kd, version, mac)


def _check_mac(
    signer: Signer, header: bytes | memoryview, key: str, level: int, payload, mac: bytes
) -> None:
    expected = signer.start(header, key, level)
    expected.update(payload)
    if not hmac.compare_digest(expected.digest(), mac):
        raise _forged(key, level, "its signature (HMAC-SHA256) does not match")


def unpack(data: bytes | memoryview, key: str, level: int, signer: Signer | None = None) -> bytes:
    """The verified payload of a complete record, or ``ChunkCorrupt`` (``ChunkForged`` when
    ``signer`` is given and the record is not signed with its secret for this key and level)."""
    header = parse_header(data, key, level, signer)
    if header.version == VERSION_SIGNED and header.mac is None:
        raise ChunkCorrupt(
            f"chunk {key} level {level}: record is {len(data)} bytes, shorter than its header"
        )
    payload = memoryview(data)[header.size :]
    if len(payload) != header.payload_len:
        raise ChunkCorrupt(
            f"chunk {key} level {level}: payload is {len(payload)} bytes, "
            f"header says {header.payload_len} (truncated?)"
        )
    if hashlib.sha256(payload).digest() != header.sha256:
        raise ChunkCorrupt(
            f"chunk {key} level {level}: checksum mismatch, the stored bytes are damaged"
        )
    if signer is not None:
        _check_mac(signer, memoryview(data)[:HEADER_SIZE], key, level, payload, header.mac)
    return bytes(payload)


def iter_payload(
    read: Callable[[int], bytes],
    key: str,
    level: int,
    block_size: int,
    signer: Signer | None = None,
    check_size: Callable[[int], None] | None = None,
) -> Iterator[bytes]:
    """Stream a record's payload through ``read(n)`` (sequential reads) in blocks.

    The checksum (and, with ``signer``, the MAC) covers the whole payload, so it is checked
    after the last block: blocks are provisional until the iterator ends without
    ``ChunkCorrupt``. ``check_size(record bytes)`` is called once the header is read, before
    any payload (a store's ``max_record_bytes``).
    """
    head = read(HEADER_SIZE)
    header = parse_header(head, key, level, signer)
    mac = None
    if header.version == VERSION_SIGNED:
        mac = read(MAC_SIZE)
        if len(mac) != MAC_SIZE:
            raise ChunkCorrupt(f"chunk {key} level {level}: record is shorter than its header")
    if check_size is not None:
        check_size(header.size + header.payload_len)
    digest, remaining = hashlib.sha256(), header.payload_len
    keyed = signer.start(head, key, level) if signer is not None else None
    while remaining > 0:
        block = read(min(block_size, remaining))
        if not block:
            break
        digest.update(block)
        if keyed is not None:
            keyed.update(block)
        remaining -= len(block)
        yield block
    if remaining or read(1) or digest.digest() != header.sha256:
        raise ChunkCorrupt(
            f"chunk {key} level {level}: stored payload is truncated or fails its checksum"
        )
    if keyed is not None and not hmac.compare_digest(keyed.digest(), mac):
        raise _forged(key, level, "its signature (HMAC-SHA256) does not match")


def pack_at(
    address: RecordAddress, payload: bytes | bytearray | memoryview, signer: Signer | None = None
) -> bytes:
    """:func:`pack` of ``payload`` for the place of ``address``: what a backend stores there."""
    return pack(*locate(address), payload, signer)


def unpack_at(
    data: bytes | memoryview, address: RecordAddress, signer: Signer | None = None
) -> bytes:
    """:func:`unpack` of a record read at ``address`` (``ChunkStore.read_records``): the
    payload, verified against the record's place and, with ``signer``, its signature."""
    return unpack(data, *locate(address), signer)
