"""Where a transport's loads read the store from: directly, or over an emulated link."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from cachegen.connector.config import RequestOptions
from cachegen.connector.link_emulation import link_opener
from cachegen.connector.load_history import link_key
from cachegen.stream import ChunkSource, DirectSource


class LinkPool:
    """Sources of ``store``: the store itself, or where a request names a rate or an RTT, a
    link the lab emulates with ``shaper`` (one per rate and RTT, kept open for the next loads)."""

    def __init__(self, store: Any, shaper: str) -> None:
        self.store = store
        self.shaper = shaper
        self.direct = DirectSource(store)
        self._links: dict[tuple[float | None, float], ChunkSource] = {}
        self._exits = contextlib.ExitStack()
        self._lock = threading.Lock()

    def source(self, options: RequestOptions) -> ChunkSource:
        """Where ``options``' load reads from. A link is started on first use and kept: its
        chunk server is a child process (a remote machine's stand-in) whose start-up must not
        be charged to every load's TTFT."""
        if options.bandwidth_mbps is None and not options.rtt_ms:
            return self.direct
        key = link_key(options)
        with self._lock:
            if key not in self._links:
                link = link_opener()(
                    self.store,
                    bandwidth_mbps=options.bandwidth_mbps,
                    rtt_ms=options.rtt_ms,
                    shaper=self.shaper,
                )
                self._links[key] = self._exits.enter_context(link).source
            return self._links[key]

    def close(self) -> None:
        self._exits.close()
