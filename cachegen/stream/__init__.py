"""Loading encoded chunks pipelined with decoding, at levels a controller picks per chunk.

    from cachegen.store import open_store, chunk_keys, RecordAddress
    from cachegen.stream import DirectSource, stream_load, AdaptiveController, RECOMPUTE

    records = [RecordAddress.of(key, "cachegen-2") for key in keys]
    stats = stream_load(DirectSource(store), records, decode, consume)
    # or: controller=AdaptiveController(slo_s, sizes, chunk_tokens, prefill_tokens_per_s=...)
    # or: controller=FastestController(options, chunk_tokens, max_loss_pct=..., ...)

A source over an emulated link (a rate, an RTT) comes from the lab: ``cachegen_lab.network``.
Errors are ``cachegen.store.StoreError`` (ChunkMissing, ChunkCorrupt, StoreUnavailable) or
``StreamError`` (StreamTimeout, StreamProtocolError); both derive from CacheGenError and
carry ``.stats`` (``stats.n_loaded`` chunks were consumed before the failure).
See docs/streaming.md.
"""

from cachegen.stream.controller import (
    DECODE_EWMA,
    RECOMPUTE,
    AdaptiveController,
    Decision,
    FastestController,
    LoadEstimator,
    Option,
    host_bound_mbps,
)
from cachegen.stream.errors import StreamError, StreamProtocolError, StreamTimeout
from cachegen.stream.loader import ChunkStat, LoadStats, stream_load
from cachegen.stream.source import ChunkSource, DirectSource

__all__ = [
    "DECODE_EWMA",
    "RECOMPUTE",
    "AdaptiveController",
    "ChunkSource",
    "ChunkStat",
    "Decision",
    "DirectSource",
    "FastestController",
    "host_bound_mbps",
    "LoadEstimator",
    "LoadStats",
    "Option",
    "StreamError",
    "StreamProtocolError",
    "StreamTimeout",
    "stream_load",
]
