"""Typed store errors.

Every one of them means "these chunks cannot be served right now": a caller that holds the
text (the vLLM connector) turns any ``StoreError`` into recomputation of the affected tokens.
"""

from cachegen.errors import CacheGenError


class StoreError(CacheGenError):
    """Base class for chunk-store failures."""


class StoreConfigError(StoreError):
    """A store URL or option is unusable (unknown scheme, bad path, bad option value)."""


class StoreUnavailable(StoreError):
    """The backend cannot be reached or stopped answering (e.g. redis-server is down)."""


class ChunkMissing(StoreError):
    """The requested chunk is not stored at the requested quality level."""


class ChunkCorrupt(StoreError):
    """A stored or received chunk failed its length, key or checksum verification."""


class ChunkForged(ChunkCorrupt):
    """A stored or received chunk failed its keyed signature (HMAC) under the store's secret:
    it was written without that secret (unsigned, or with another secret), altered since, or
    copied from another key or level. Like any ``StoreError``, the load recomputes instead."""


class ChunkTooLarge(StoreError):
    """A record is larger than the store's ``max_record_bytes``: refused before reading it
    whole (or, for a put, before storing it)."""
