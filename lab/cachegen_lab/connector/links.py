"""Where the lab connector's loads read the store from: directly, or over an emulated link."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable
from typing import Any

from cachegen.connector.config import RequestOptions
from cachegen.stream import ChunkSource, DirectSource
from cachegen_lab.network.link import open_link


class EmulatedLinks:
    """Sources of ``store``: the store itself, or where a request names a rate or an RTT, a link
    emulated with ``shaper`` (one per rate and RTT, kept open for the next loads: its chunk
    server's start-up must not be charged to every load's TTFT)."""

    def __init__(self, store: Any, shaper: str) -> None:
        self.store = store
        self.shaper = shaper
        self.direct = DirectSource(store)
        self._links: dict[Hashable, ChunkSource] = {}
        self._exits = contextlib.ExitStack()
        self._lock = threading.Lock()

    def link(self, options: RequestOptions) -> Hashable:
        """A request's (rate, RTT); the library's own options (a save's lookups, the lab's
        direct reads) name none: the store itself."""
        return (getattr(options, "bandwidth_mbps", None), float(getattr(options, "rtt_ms", 0.0)))

    def nominal_mbps(self, options: RequestOptions) -> float | None:
        return self.link(options)[0]

    def source(self, options: RequestOptions) -> ChunkSource:
        bandwidth_mbps, rtt_ms = key = self.link(options)
        if bandwidth_mbps is None and not rtt_ms:
            return self.direct
        with self._lock:
            if key not in self._links:
                link = open_link(
                    self.store, bandwidth_mbps=bandwidth_mbps, rtt_ms=rtt_ms, shaper=self.shaper
                )
                self._links[key] = self._exits.enter_context(link).source
            return self._links[key]

    def close(self) -> None:
        self._exits.close()
