"""This engine's saves whose first pass the workers have not stored yet, and the requests held
back for them (``save_wait_ms``): a repeat of a prompt that finished its prefill a moment ago
waits for its chunks instead of computing them again."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class PendingSave:
    """A save sent to the workers whose first pass they have not reported stored yet."""

    token_ids: list[int]  # whole chunks
    codecs: frozenset[str]  # the codecs it writes (``adaptive`` writes ``cachegen``'s)
    first_chunk: int  # chunks before it were stored already
    salt: str | None


class PendingSaves:
    """The pending saves by id, and whether a request waits for one of them."""

    def __init__(self, chunk_tokens: int, save_wait_ms: float) -> None:
        self.chunk_tokens = chunk_tokens
        self.save_wait_ms = save_wait_ms
        self._saves: dict[int, PendingSave] = {}

    def add(self, save_id: int, save: PendingSave) -> None:
        self._saves[save_id] = save

    def done(self, save_id: int) -> None:
        """The workers stored the first pass of save ``save_id``, or gave it up."""
        self._saves.pop(save_id, None)

    def holds(self, tracked: Any, codec: str, num_computed_tokens: int) -> bool:
        """Whether to hold ``tracked`` (the scheduler's record of a request) back, since vLLM
        asks again later: a pending save of chunks it could load under ``codec``'s keys writes
        them still, and it has waited less than ``save_wait_ms`` since the first ask."""
        if self.save_wait_ms <= 0:
            return False
        if tracked.save_wait_since is not None:
            waited = time.monotonic() - tracked.save_wait_since
            if waited * 1000.0 >= self.save_wait_ms:
                tracked.report.setdefault("save_wait_s", waited)
                tracked.report["save_wait_timed_out"] = True
                return False
        if self._writes_its_chunks(tracked, codec, num_computed_tokens):
            if tracked.save_wait_since is None:
                tracked.save_wait_since = time.monotonic()
            return True
        if tracked.save_wait_since is not None:
            tracked.report.setdefault("save_wait_s", time.monotonic() - tracked.save_wait_since)
        return False

    def _writes_its_chunks(self, tracked: Any, codec: str, num_computed_tokens: int) -> bool:
        prompt = tracked.request.prompt_token_ids or []
        C = self.chunk_tokens
        usable = (len(prompt) - 1) // C  # whole chunks before the token vLLM must compute
        needed_from = num_computed_tokens // C
        for save in self._saves.values():
            if save.salt != tracked.options.salt or codec not in save.codecs:
                continue
            if _shared_chunks(prompt, save.token_ids, C, usable) > max(
                save.first_chunk, needed_from
            ):
                return True
        return False


def _shared_chunks(a: list[int], b: list[int], chunk_tokens: int, limit: int) -> int:
    """Leading whole chunks (at most ``limit``) that token lists ``a`` and ``b`` share."""
    count = 0
    while count < limit:
        span = slice(count * chunk_tokens, (count + 1) * chunk_tokens)
        if len(a) < span.stop or len(b) < span.stop or a[span] != b[span]:
            break
        count += 1
    return count
