"""Encoded-chunk stores addressed by URL (local directory, Redis / Valkey / Redis Cluster).

store = open_store("file:///var/cache/kv")          # or "redis://127.0.0.1:6379/0"
store = open_store(url, secret=b"...")               # signed records (or CACHEGEN_STORE_SECRET)
keys = chunk_keys(spec.identity(), codec_profile_id, token_ids, chunk_tokens,
                  weights=spec.served_weights())     # ModelSpec: cachegen.models
records = [RecordAddress.of(key, "cachegen-11-packed") for key in keys]
store.write(records[0], blob); store.read(records[0])
n = stored_prefix(store, [[r] for r in records])     # leading chunks stored in full
"""

from cachegen.store.address import FULL, SLIDING, RecordAddress
from cachegen.store.base import ChunkInfo, ChunkStore, StoreStats, stored_prefix
from cachegen.store.errors import (
    ChunkCorrupt,
    ChunkForged,
    ChunkMissing,
    ChunkTooLarge,
    StoreConfigError,
    StoreError,
    StoreUnavailable,
)
from cachegen.store.keys import chunk_keys, namespace, validate_key
from cachegen.store.url import default_store_url, open_store, parse_size

__all__ = [
    "FULL",
    "SLIDING",
    "RecordAddress",
    "stored_prefix",
    "ChunkCorrupt",
    "ChunkForged",
    "ChunkInfo",
    "ChunkMissing",
    "ChunkTooLarge",
    "ChunkStore",
    "StoreConfigError",
    "StoreError",
    "StoreStats",
    "StoreUnavailable",
    "chunk_keys",
    "default_store_url",
    "namespace",
    "open_store",
    "parse_size",
    "validate_key",
]
