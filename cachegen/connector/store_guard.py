"""Nothing the store does holds vLLM's scheduler: each question with a deadline, and a breaker.

The scheduler asks the store on vLLM's step: which prefix of a prompt it holds, what a save
still has to write, how large a load plan's records are. ``StoreGuard.ask`` puts each question
to the store on a thread of its own and waits at most ``store_deadline_ms`` for the answer; an
answer that comes later is dropped, and the request computes its prompt (a miss). A failure or
a late answer opens the breaker: for ``store_backoff_s`` the store counts as down and every
question is refused at once, without touching it; after that one question at a time probes it,
and the first answer in time closes the breaker again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from cachegen.connector.errors import ConnectorError

T = TypeVar("T")

# Reason codes of a question the store did not answer (reports and /metrics).
STORE_TIMEOUT = "store_timeout"  # no answer within the deadline
STORE_ERROR = "store_error"  # the store answered with an error
STORE_DOWN = "store_down"  # not asked: the breaker is open
QUESTION_THREADS = 2  # a hung question holds one; the next probe gets the other


class StoreUnanswered(ConnectorError):
    """The store gave no answer in time; ``reason`` is one of the reason codes above."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class StoreGuard:
    """The deadline and the breaker around one engine's store questions."""

    def __init__(
        self,
        deadline_s: float,
        backoff_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deadline_s = deadline_s
        self.backoff_s = backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until: float | None = None  # the breaker is open until then
        self._probing = False  # a question is probing a store counted down
        self._pool = ThreadPoolExecutor(QUESTION_THREADS, thread_name_prefix="cachegen-store")

    @property
    def down(self) -> bool:
        with self._lock:
            return self._down_until is not None

    def ask(self, question: Callable[[], T], what: str) -> T:
        """``question()``'s answer, if it comes within the deadline; else ``StoreUnanswered``
        (``what`` names the question in its message)."""
        self._admit(what)
        future = self._pool.submit(question)
        try:
            answer = future.result(timeout=self.deadline_s)
        except FutureTimeout:
            self._trip()
            ms = round(self.deadline_s * 1000)
            raise StoreUnanswered(STORE_TIMEOUT, f"{what}: no answer within {ms} ms") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the store is a miss
            self._trip()
            raise StoreUnanswered(STORE_ERROR, f"{what}: {type(exc).__name__}: {exc}") from exc
        self._recovered()
        return answer

    def _admit(self, what: str) -> None:
        """Let a question through: always while the store is up; after the back-off, one
        question at a time (the probe); else refuse it at once."""
        with self._lock:
            if self._down_until is None:
                return
            left = self._down_until - self._clock()
            if left > 0 or self._probing:
                wait = f"for {left:.1f} s more" if left > 0 else "while a probe is out"
                raise StoreUnanswered(STORE_DOWN, f"{what}: the store is counted down {wait}")
            self._probing = True

    def _trip(self) -> None:
        with self._lock:
            self._down_until = self._clock() + self.backoff_s
            self._probing = False

    def _recovered(self) -> None:
        with self._lock:
            self._down_until = None
            self._probing = False

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
