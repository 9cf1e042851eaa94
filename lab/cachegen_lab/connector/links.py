"""Where the lab connector's loads read the store from: directly, or over an emulated link."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable
from typing import Any

from cachegen.stream import ChunkSource, DirectSource
from cachegen_lab.connector.options import LabRequestOptions
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

    def link(self, options: LabRequestOptions) -> Hashable:
        return (options.bandwidth_mbps, float(options.rtt_ms))

    def nominal_mbps(self, options: LabRequestOptions) -> float | None:
        return options.bandwidth_mbps

    def source(self, options: LabRequestOptions) -> ChunkSource:
        if options.bandwidth_mbps is None and not options.rtt_ms:
            return self.direct
        key = self.link(options)
        with self._lock:
            if key not in self._links:
                link = open_link(
                    self.store,
                    bandwidth_mbps=options.bandwidth_mbps,
                    rtt_ms=options.rtt_ms,
                    shaper=self.shaper,
                )
                self._links[key] = self._exits.enter_context(link).source
            return self._links[key]

    def close(self) -> None:
        self._exits.close()
