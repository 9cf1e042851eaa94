"""A request's questions to the store, asked in the background so that vLLM's step never waits.

When the scheduler first meets a request it puts its questions to the store (``StoreGuard``):
the lookup (how much of the prompt's prefix is stored, and the load plan of that prefix) and,
for a request whose prompt is saved, how many of its chunks are stored already. vLLM asks the
connector for the lookup's answer on each step until it comes (``Lookup.matched`` is None
until then: vLLM skips the request on that step and schedules the others); an answer that has
not come within ``store_deadline_ms`` is a miss, and opens the store's breaker.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.index import StoreIndex
from cachegen.connector.load_plan import LoadPlan, plan_load
from cachegen.connector.store_guard import STORE_DOWN, PendingAnswer, StoreGuard, StoreUnanswered


@dataclass(frozen=True)
class LookupAnswer:
    """Tokens ``[0, end)`` of the prompt are loadable; ``plan`` loads ``[computed, end)``."""

    end: int
    plan: LoadPlan | None


@dataclass
class Lookup:
    """A lookup asked with ``computed`` tokens already in vLLM's cache; ``matched``: the tokens
    beyond those it found (None until answered)."""

    computed: int
    pending: PendingAnswer[LookupAnswer]
    matched: int | None = None
    plan: LoadPlan | None = None


class StoreQuestions:
    """Puts a request's questions to the store and reads their answers."""

    def __init__(
        self, index: StoreIndex, guard: StoreGuard, config: ConnectorConfig, block_size: int
    ) -> None:
        self.index = index
        self.guard = guard
        self.config = config
        self.block_size = block_size

    def lookup(self, prompt: list[int], options: RequestOptions, computed: int) -> Lookup:
        """The lookup of ``prompt`` with ``computed`` tokens in vLLM's cache, asked now."""
        # Never the whole prompt: vLLM must compute at least one token to produce logits.
        limit = (len(prompt) - 1) // self.block_size * self.block_size

        def question() -> LookupAnswer:
            end = self.index.loadable_tokens(prompt, options, computed, limit)
            if end <= computed:
                return LookupAnswer(end, None)
            return LookupAnswer(end, self._plan(prompt, computed, end, options))

        return Lookup(computed, self.guard.submit(question, "lookup"))

    @staticmethod
    def matched(lookup: Lookup) -> int | None:
        """The tokens the lookup found beyond those computed; None while it is out. Raises
        ``StoreUnanswered`` when it failed or came late."""
        if lookup.matched is None:
            if not lookup.pending.ready():
                return None
            answer = lookup.pending.answer()
            lookup.matched, lookup.plan = max(0, answer.end - lookup.computed), answer.plan
        return lookup.matched

    def load_plan(
        self, lookup: Lookup, prompt: list[int], end: int, options: RequestOptions
    ) -> LoadPlan:
        """The plan of the load vLLM granted, ``[lookup.computed, end)``: the lookup's own,
        or (vLLM granted less) asked now, within the deadline."""
        plan = lookup.plan
        if plan is not None and plan.begin == lookup.computed and plan.end == end:
            return plan
        return self.guard.ask(
            lambda: self._plan(prompt, lookup.computed, end, options), "load plan"
        )

    def prefix(self, prompt: list[int], end: int) -> list[int]:
        """The prompt through the last chunk a load of its tokens up to ``end`` fetches."""
        last_chunk_end = -(-end // self.config.chunk_tokens) * self.config.chunk_tokens
        return list(prompt[:last_chunk_end])

    def _plan(self, prompt: list[int], begin: int, end: int, options: RequestOptions) -> LoadPlan:
        prefix = self.prefix(prompt, end)
        return plan_load(self.index, prefix, begin, end, options, self.config.max_load_bytes)

    def saved_chunks(self, prompt: list[int], salt: str | None) -> PendingAnswer[int] | None:
        """How many leading whole chunks of ``prompt`` every form its save writes holds,
        asked now; None for a prompt without a whole chunk."""
        full = len(prompt) // self.config.chunk_tokens * self.config.chunk_tokens
        if full == 0:
            return None
        modes = self.config.save_modes
        return self.guard.submit(
            lambda: self.index.saved_chunks(prompt[:full], modes, salt), "save plan"
        )

    def stored_chunks(self, pending: PendingAnswer[int] | None, load_failed: bool) -> int:
        """The leading chunks of the prompt stored already, as the store answered when the
        request came; 0 (the worker skips each record it finds stored) while the answer is
        out, after a failed load (it may have dropped a damaged chunk since), and when the
        question was refused while a probe, since answered, was out. Raises
        ``StoreUnanswered`` when the store failed or is still counted down."""
        if pending is None or load_failed or not pending.ready():
            return 0
        try:
            return pending.answer()
        except StoreUnanswered as exc:
            if exc.reason == STORE_DOWN and not self.guard.down:
                return 0
            raise
