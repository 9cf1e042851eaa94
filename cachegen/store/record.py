"""The stored (and transmitted) form of one chunk: a 64-byte header plus the payload.

    offset size field
         0    4 magic b"CGCK"
         4    1 format version (1)
         5    1 reserved (0)
         6    2 quality level, uint16 little-endian
         8    8 payload length in bytes, uint64 little-endian
        16   32 SHA-256 of the payload
        48   16 first 16 bytes of SHA-256(key), binding the record to its key

The same bytes are what a store holds and what the chunk server sends, so a reader can
verify end to end that it received the chunk it asked for, complete and unaltered.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cachegen.store.errors import ChunkCorrupt

MAGIC = b"CGCK"
VERSION = 1
HEADER = struct.Struct("<4sBBHQ32s16s")
HEADER_SIZE = HEADER.size  # 64


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()[:16]


@dataclass(frozen=True)
class RecordHeader:
    level: int
    payload_len: int
    sha256: bytes
    key_digest: bytes


def pack(key: str, level: int, payload: bytes | bytearray | memoryview) -> bytes:
    header = HEADER.pack(
        MAGIC, VERSION, 0, level, len(payload), hashlib.sha256(payload).digest(), key_digest(key)
    )
    return header + bytes(payload)


def parse_header(data: bytes | memoryview, key: str, level: int) -> RecordHeader:
    """Check the header of a record for ``(key, level)``; the payload is not looked at."""
    if len(data) < HEADER_SIZE:
        raise ChunkCorrupt(
            f"chunk {key} level {level}: record is {len(data)} bytes, shorter than its header"
        )
    magic, version, _, rec_level, length, digest, kd = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ChunkCorrupt(f"chunk {key} level {level}: not a cachegen chunk record (bad magic)")
    if version != VERSION:
        raise ChunkCorrupt(
            f"chunk {key} level {level}: record format version {version}, "
            f"this cachegen reads {VERSION}"
        )
    if kd != key_digest(key) or rec_level != level:
        raise ChunkCorrupt(f"chunk {key} level {level}: record belongs to another key or level")
    return RecordHeader(rec_level, length, digest, kd)


def unpack(data: bytes | memoryview, key: str, level: int) -> bytes:
    """The verified payload of a complete record, or ``ChunkCorrupt``."""
    header = parse_header(data, key, level)
    payload = memoryview(data)[HEADER_SIZE:]
    if len(payload) != header.payload_len:
        raise ChunkCorrupt(
            f"chunk {key} level {level}: payload is {len(payload)} bytes, "
            f"header says {header.payload_len} (truncated?)"
        )
    if hashlib.sha256(payload).digest() != header.sha256:
        raise ChunkCorrupt(
            f"chunk {key} level {level}: checksum mismatch, the stored bytes are damaged"
        )
    return bytes(payload)


def iter_payload(
    read: Callable[[int], bytes], key: str, level: int, block_size: int
) -> Iterator[bytes]:
    """Stream a record's payload through ``read(n)`` (sequential reads) in blocks.

    The checksum covers the whole payload, so it is checked after the last block: blocks are
    provisional until the iterator ends without ``ChunkCorrupt``.
    """
    header = parse_header(read(HEADER_SIZE), key, level)
    digest, remaining = hashlib.sha256(), header.payload_len
    while remaining > 0:
        block = read(min(block_size, remaining))
        if not block:
            break
        digest.update(block)
        remaining -= len(block)
        yield block
    if remaining or read(1) or digest.digest() != header.sha256:
        raise ChunkCorrupt(
            f"chunk {key} level {level}: stored payload is truncated or fails its checksum"
        )
