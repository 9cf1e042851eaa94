"""The records a save writes, in the order it writes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachegen.connector.parts import RecordParts
from cachegen.kv import KVCache
from cachegen.modes import Form
from cachegen.store.address import RecordAddress


@dataclass(frozen=True, eq=False)
class SaveRecord:
    """One record a save writes: ``kv`` (a chunk, or one part of it) at ``address`` (its
    form's codec encodes it); ``first``: part of the save's first pass, after which the chunk
    is loadable (``LevelPolicy.first_forms``)."""

    address: RecordAddress
    kv: KVCache
    first: bool


@dataclass(frozen=True)
class SavePrefix:
    """What a save stores of a prompt ``token_ids``: its whole chunks in every one of
    ``modes``, in the key scope ``salt``; chunks before chunk ``sliding_from`` get no sliding
    part (their sliding layers' KV is not valid: a load skipped it). The connector's
    ``SaveTask`` has these fields too."""

    token_ids: Sequence[int]
    modes: Sequence[str]
    sliding_from: int = 0
    salt: str | None = None


@dataclass(frozen=True)
class ModeLadder:
    """One codec's part of a save: the keys of the chunks saved, the forms stored per
    chunk, and those of them written in the first pass."""

    keys: Sequence[str]
    forms: Sequence[Form]
    first: Sequence[Form]


def plan_save(
    kv: KVCache, ladders: Sequence[ModeLadder], parts: RecordParts, sliding_from: int
) -> list[SaveRecord]:
    """The records of a save of ``kv`` (whole chunks, from a chunk boundary): first the first
    forms of every codec of ``ladders`` for each chunk in prefix order (a chunk is loadable
    once they are stored, and a repeat of the prompt needs the leading chunks first), then the
    other forms, again in prefix order."""
    first_chunk = kv.start // parts.chunk_tokens
    passes: tuple[list[SaveRecord], list[SaveRecord]] = ([], [])
    for at, chunk in enumerate(kv.chunks(parts.chunk_tokens)):
        chunk_parts = parts.save_parts(chunk, first_chunk + at, sliding_from)
        for ladder in ladders:
            for part, part_kv in chunk_parts:
                for form in ladder.forms:
                    is_first = form in ladder.first
                    address = RecordAddress.of(ladder.keys[at], form, part)
                    passes[not is_first].append(SaveRecord(address, part_kv, is_first))
    return passes[0] + passes[1]
