"""The records a save writes, in the order it writes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachegen.connector.parts import RecordParts
from cachegen.kv import KVCache


@dataclass(frozen=True, eq=False)
class SaveRecord:
    """One record a save writes: ``kv`` (a chunk, or one part of it) under ``key`` at
    ``level`` of ``mode``'s codec; ``first``: part of the save's first pass, after which the
    chunk is loadable (``LevelPolicy.first_levels``)."""

    mode: str
    key: str
    level: int
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
    """One codec's part of a save: the keys of the chunks saved, the levels stored per
    chunk, and those of them written in the first pass."""

    mode: str
    keys: Sequence[str]
    levels: Sequence[int]
    first: Sequence[int]


def plan_save(
    kv: KVCache, ladders: Sequence[ModeLadder], parts: RecordParts, sliding_from: int
) -> list[SaveRecord]:
    """The records of a save of ``kv`` (whole chunks, from a chunk boundary): first the first
    levels of every codec of ``ladders`` for each chunk in prefix order (a chunk is loadable
    once they are stored, and a repeat of the prompt needs the leading chunks first), then the
    other levels, again in prefix order."""
    first_chunk = kv.start // parts.chunk_tokens
    passes: tuple[list[SaveRecord], list[SaveRecord]] = ([], [])
    for at, chunk in enumerate(kv.chunks(parts.chunk_tokens)):
        chunk_parts = parts.save_parts(chunk, first_chunk + at, sliding_from)
        for ladder in ladders:
            for part, part_kv in chunk_parts:
                key = parts.record_key(ladder.keys[at], part)
                for level in ladder.levels:
                    is_first = level in ladder.first
                    record = SaveRecord(ladder.mode, key, level, part_kv, is_first)
                    passes[not is_first].append(record)
    return passes[0] + passes[1]
