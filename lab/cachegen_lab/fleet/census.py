"""What a run wrote to the fleet's store: its entries counted by kind and by the form each one
holds, and each one read back and verified.

The fleet's store may hold what earlier runs wrote (a configuration's runs share its store; on a
shared Redis base, every configuration's tenant shares it), so a run's census is the difference
between the entries listed before its requests and after them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from cachegen.codec import CodecError, form_of
from cachegen.modes import Form
from cachegen.store import ChunkInfo, ChunkStore, StoreError, open_store
from cachegen.store.keys import SLIDING_SUFFIX

# A listed record as the store's listing names it (its key and the backend's own slot); only
# compared between two listings and handed back to the store, never written out.
Entry = tuple[str, int]
UNKNOWN = "unknown"  # the form of a record that is not a bitstream
READ_BATCH = 16  # entries read back per round trip: a few MB of raw chunks at most


def entries(url: str) -> dict[Entry, int]:
    """Every record in the store at ``url`` with its payload size in bytes."""
    with open_store(url) as store:
        return {_entry(info): info.size for info in store.list()}


def _entry(info: ChunkInfo) -> Entry:
    return info.key, info.level


def written(url: str, before: dict[Entry, int]) -> dict[str, Any]:
    """The records of the store at ``url`` that ``before`` (its earlier listing) lacks: their
    distinct keys (``chunks``, as ``StoreStats`` calls them), count and payload bytes, per
    kind (``full``: a chunk, or the full-attention part of a chunk of a model with
    sliding-window layers; ``sliding``: that part) and per form (its name, read from the
    record's bitstream header; ``unknown``: not a bitstream), and ``unreadable``: how many of
    them do not read back whole and verified (missing, corrupt, forged or too large)."""
    with open_store(url) as store:
        new = sorted((info for info in store.list() if _entry(info) not in before), key=_entry)
        forms, unreadable = _read_back(store, new)
    return {
        "chunks": len({info.key for info in new}),
        "entries": len(new),
        "payload_bytes": sum(info.size for info in new),
        "kinds": _by(new, lambda info: "sliding" if info.key.endswith(SLIDING_SUFFIX) else "full"),
        "forms": _by(new, forms.__getitem__),
        "unreadable": unreadable,
    }


def _by(new: list[ChunkInfo], group: Callable[[ChunkInfo], str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for info in new:
        tally = out.setdefault(group(info), {"entries": 0, "payload_bytes": 0})
        tally["entries"] += 1
        tally["payload_bytes"] += info.size
    return out


def _read_back(store: ChunkStore, new: list[ChunkInfo]) -> tuple[dict[ChunkInfo, str], int]:
    """Each record's form name and how many do not read back verified: each is read once,
    whole; the form of one that does not read is taken from its header alone."""
    forms: dict[ChunkInfo, str] = {}
    unreadable = 0
    for batch in _batches(new, READ_BATCH):
        for info, found in zip(batch, store.read_listed(batch), strict=True):
            if isinstance(found, StoreError):
                unreadable += 1
                forms[info] = _label(store.form_of(info))
            else:
                forms[info] = _label(_payload_form(found))
    return forms, unreadable


def _payload_form(payload: bytes) -> Form | None:
    try:
        return form_of(payload)
    except CodecError:
        return None


def _label(form: Form | None) -> str:
    return UNKNOWN if form is None else form.label


def _batches(items: list[ChunkInfo], size: int) -> Iterable[list[ChunkInfo]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
