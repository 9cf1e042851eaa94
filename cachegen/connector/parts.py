"""Which records hold a chunk, and which of them a load fetches.

A model that mixes full-attention and sliding-window layers (Gemma 3) stores each chunk as two
records (its *parts*, ``cachegen.store.address``): the full-attention layers and the sliding
layers. A load of a prefix ending at token ``P``
fetches the sliding part only of the chunks that intersect ``[P - window, P)``
(``skip_out_of_window``, see :func:`window_chunks`); the sliding layers never read the other
chunks' keys. Models with one kind of layer keep one record per chunk (part None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachegen.connector.config import RequestOptions
from cachegen.kv import KVCache
from cachegen.models import ModelSpec, attention_windows
from cachegen.modes import RECOMPUTE, Form
from cachegen.store.address import FULL, SLIDING, RecordAddress

# A load plan: the records a load fetches, in order, as (chunk index, part).
Plan = list[tuple[int, str | None]]


def window_chunks(end: int, chunk_tokens: int, window: int) -> range:
    """Indices of the chunks (of ``chunk_tokens`` tokens) that intersect tokens
    ``[end - window, end)``: the only chunks whose keys a sliding-window layer of ``window``
    tokens reads when the prefix ``[0, end)`` is continued (from the token at ``end`` on)."""
    if end <= 0:
        return range(0)
    return range(max(0, end - window) // chunk_tokens, -(-end // chunk_tokens))


@dataclass(frozen=True)
class RecordParts:
    """The parts of a chunk for a model with these layers: ``full_layers`` and
    ``sliding_layers`` (indices), ``window`` (the widest sliding window, tokens)."""

    full_layers: tuple[int, ...]
    sliding_layers: tuple[int, ...]
    window: int
    chunk_tokens: int

    @classmethod
    def of(cls, spec: ModelSpec, chunk_tokens: int) -> RecordParts:
        windows = attention_windows(spec.config)
        return cls(
            full_layers=tuple(i for i, w in enumerate(windows) if w is None),
            sliding_layers=tuple(i for i, w in enumerate(windows) if w is not None),
            window=max((w for w in windows if w is not None), default=0),
            chunk_tokens=chunk_tokens,
        )

    @property
    def split(self) -> bool:
        """Two records per chunk: only for models with both kinds of layers."""
        return bool(self.full_layers) and bool(self.sliding_layers)

    def part_records(self, chunk_key: str, form: Form) -> list[RecordAddress]:
        """Every record of the chunk ``chunk_key`` in ``form``: the whole chunk, or for a
        model with sliding-window and full-attention layers, its two parts."""
        if not self.split:
            return [RecordAddress.of(chunk_key, form)]
        return [RecordAddress.of(chunk_key, form, FULL), RecordAddress.of(chunk_key, form, SLIDING)]

    def sliding_from(self, end: int, options: RequestOptions) -> int:
        """The first chunk whose sliding part a load of the prefix ``[0, end)`` fetches (0: the
        sliding part of every chunk, also for models without two kinds of layers)."""
        if not self.split or not options.skip_out_of_window:
            return 0
        return window_chunks(end, self.chunk_tokens, self.window).start

    def load_plan(
        self, first_chunk: int, num_chunks: int, end: int, options: RequestOptions
    ) -> Plan:
        """The records a load fetches, in order: ``(chunk index, part)`` with part ``None``
        (the whole chunk) for a model with one kind of layer, else ``FULL`` for every chunk
        and ``SLIDING`` (right after it) for the chunks from :meth:`sliding_from` on."""
        chunks = range(first_chunk, first_chunk + num_chunks)
        if not self.split:
            return [(c, None) for c in chunks]
        sliding_from = self.sliding_from(end, options)
        plan: Plan = []
        for c in chunks:
            plan.append((c, FULL))
            if c >= sliding_from:
                plan.append((c, SLIDING))
        return plan

    def plan_records(
        self, keys: Sequence[str], first_chunk: int, plan: Plan, form: Form
    ) -> list[RecordAddress]:
        """The records of ``plan`` in ``form``, from the keys of its chunks (``keys[0]``:
        chunk ``first_chunk``'s)."""
        return [RecordAddress.of(keys[c - first_chunk], form, part) for c, part in plan]

    def layers(self, part: str | None) -> tuple[int, ...] | None:
        """The layers a record of ``part`` holds (None: all)."""
        return {None: None, FULL: self.full_layers, SLIDING: self.sliding_layers}[part]

    def save_parts(
        self, chunk: KVCache, index: int, sliding_from: int
    ) -> list[tuple[str | None, KVCache]]:
        """The records of chunk ``index`` (``chunk``: its KV) a save writes, as (part, KV): the
        whole chunk, or its full part and, from chunk ``sliding_from`` on, its sliding part
        (before it the sliding layers' KV is not valid: a load skipped it)."""
        if not self.split:
            return [(None, chunk)]
        parts: list[tuple[str | None, KVCache]] = [(FULL, chunk.select_layers(self.full_layers))]
        if index >= sliding_from:
            parts.append((SLIDING, chunk.select_layers(self.sliding_layers)))
        return parts

    def report(self, report: dict[str, Any], stats: Any, plan: Plan) -> dict[str, Any]:
        """A load's ``report`` (``bytes`` counts every record fetched) with, for a model of two
        parts, ``forms`` one entry per chunk (its full part's form, or what stopped one of
        its parts), the chunks whose sliding part was skipped, and the sliding parts' bytes."""
        if not report or not self.split:
            return report
        per_chunk: dict[int, list[Any]] = {}
        for (chunk, _part), form in zip(plan, stats.forms):
            per_chunk.setdefault(chunk, []).append(form)
        forms = []
        for chunk in sorted(per_chunk):
            stopped = [x for x in per_chunk[chunk] if x in (RECOMPUTE, None)]
            forms.append(stopped[0] if stopped else per_chunk[chunk][0])
        report["forms"] = forms
        report["window_skipped_chunks"] = len(per_chunk) - sum(p == SLIDING for _, p in plan)
        report["sliding_bytes"] = sum(
            c.bytes
            for c in stats.chunks
            if 0 <= c.index < len(plan) and plan[c.index][1] == SLIDING
        )
        return report
