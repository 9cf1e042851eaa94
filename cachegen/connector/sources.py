"""Where a transport's loads read the store from.

A server reads its store directly (``DirectSources``). Nothing a request sends chooses another
path: the lab's harness, which emulates links for experiments, plugs in a ``SourcePool`` of its
own through its connector subclass (``cachegen_lab.connector``), and a server never loads it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

from cachegen.stream import ChunkSource, DirectSource


class SourcePool(Protocol):
    """The sources a transport's loads read from, one per link."""

    def source(self, options: Any) -> ChunkSource:
        """Where a load with request options ``options`` reads its records."""

    def link(self, options: Any) -> Hashable:
        """What names that source's link: the key under which its goodput is remembered."""

    def nominal_mbps(self, options: Any) -> float | None:
        """The link's configured rate in Mbit/s, where it has one (None: not known)."""

    def close(self) -> None: ...


class DirectSources:
    """The store itself, for every request: the one source of a server."""

    def __init__(self, store: Any) -> None:
        self.direct = DirectSource(store)

    def source(self, options: Any) -> ChunkSource:
        return self.direct

    def link(self, options: Any) -> Hashable:
        return None

    def nominal_mbps(self, options: Any) -> float | None:
        return None

    def close(self) -> None:
        return None
