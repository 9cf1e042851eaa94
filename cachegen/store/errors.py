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
