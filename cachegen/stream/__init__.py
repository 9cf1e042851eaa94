"""Moving encoded chunks over a bandwidth-limited link, pipelined with decoding.

    from cachegen.store import open_store, chunk_keys, longest_prefix
    from cachegen.stream import open_link, stream_load, AdaptiveController, RECOMPUTE

    with open_link(store, bandwidth_mbps=100, rtt_ms=0, shaper="token-bucket") as link:
        stats = stream_load(link.source, keys, decode, consume, level=2)
        # or: controller=AdaptiveController(slo_s, sizes, chunk_tokens, prefill_tokens_per_s=...)
        # or: controller=FastestController(options, chunk_tokens, max_loss_pct=..., ...)

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
from cachegen.stream.errors import (
    ShaperUnavailable,
    StreamError,
    StreamProtocolError,
    StreamTimeout,
)
from cachegen.stream.link import SHAPERS, Link, open_link
from cachegen.stream.loader import ChunkStat, LoadStats, stream_load
from cachegen.stream.server import ChunkServer, ChunkServerProcess
from cachegen.stream.source import ChunkSource, DirectSource, SocketSource
from cachegen.stream.traces import BandwidthTrace

__all__ = [
    "DECODE_EWMA",
    "RECOMPUTE",
    "SHAPERS",
    "AdaptiveController",
    "BandwidthTrace",
    "ChunkServer",
    "ChunkServerProcess",
    "ChunkSource",
    "ChunkStat",
    "Decision",
    "DirectSource",
    "FastestController",
    "host_bound_mbps",
    "Link",
    "LoadEstimator",
    "LoadStats",
    "Option",
    "ShaperUnavailable",
    "SocketSource",
    "StreamError",
    "StreamProtocolError",
    "StreamTimeout",
    "open_link",
    "stream_load",
]
