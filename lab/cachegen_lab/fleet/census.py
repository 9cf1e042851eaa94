"""What a run wrote to the fleet's store: its entries counted by kind and level, and each one
read back and verified.

The fleet's store may hold what earlier runs wrote (a configuration's runs share its store; on a
shared Redis base, every configuration's tenant shares it), so a run's census is the difference
between the entries listed before its requests and after them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cachegen.store import ChunkStore, StoreError, open_store
from cachegen.store.keys import SLIDING_SUFFIX

Entry = tuple[str, int]  # (key, level)
READ_BATCH = 16  # entries read back per round trip: a few MB of raw chunks at most


def entries(url: str) -> dict[Entry, int]:
    """Every ``(key, level)`` in the store at ``url`` with its payload size in bytes."""
    with open_store(url) as store:
        return _listing(store)


def _listing(store: ChunkStore) -> dict[Entry, int]:
    return {(info.key, info.level): info.size for info in store.list()}


def written(url: str, before: dict[Entry, int]) -> dict[str, Any]:
    """The entries of the store at ``url`` that ``before`` (its earlier listing) lacks: their
    distinct keys (``chunks``, as ``StoreStats`` calls them), count and payload bytes, per
    kind (``full``: a chunk, or the full-attention part of a chunk of a model with
    sliding-window layers; ``sliding``: that part) and per level, and ``unreadable``: how many
    of them do not read back whole and verified (missing, corrupt, forged or too large)."""
    with open_store(url) as store:
        new = {entry: size for entry, size in _listing(store).items() if entry not in before}
        unreadable = _unreadable(store, sorted(new))
    return {
        "chunks": len({key for key, _ in new}),
        "entries": len(new),
        "payload_bytes": sum(new.values()),
        "kinds": _by(new, lambda e: "sliding" if e[0].endswith(SLIDING_SUFFIX) else "full"),
        "levels": _by(new, lambda e: str(e[1])),
        "unreadable": unreadable,
    }


def _by(new: dict[Entry, int], group) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for entry, size in new.items():
        tally = out.setdefault(group(entry), {"entries": 0, "payload_bytes": 0})
        tally["entries"] += 1
        tally["payload_bytes"] += size
    return out


def _unreadable(store: ChunkStore, items: list[Entry]) -> int:
    return sum(
        isinstance(found, StoreError)
        for batch in _batches(items, READ_BATCH)
        for found in store.get_many(batch)
    )


def _batches(items: list[Entry], size: int) -> Iterable[list[Entry]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
