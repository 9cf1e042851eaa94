"""Nothing the store does holds vLLM's scheduler: each question with a deadline, and a breaker.

The scheduler has questions for the store: which prefix of a prompt it holds, what a save
still has to write, how large a load plan's records are. ``StoreGuard.submit`` puts a question
to the store on a thread of its own and returns at once; the scheduler polls the answer on
later steps (``PendingAnswer``), so vLLM's step never waits on the store. An answer that has
not come ``store_deadline_ms`` after the question is dropped, and the request computes its
prompt (a miss). ``StoreGuard.ask`` waits for the answer, within the same deadline, where a
step cannot go on without it. A failure or a late answer opens the breaker: for
``store_backoff_s`` the store counts as down and every question is refused at once, without
touching it; after that one question at a time probes it, and the first answer in time closes
the breaker again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

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
        pending = self.submit(question, what)
        if pending.future is not None:
            with contextlib.suppress(Exception):  # answer() tells a failure and a late answer
                pending.future.result(timeout=self.deadline_s)
        return pending.answer()

    def submit(self, question: Callable[[], T], what: str) -> PendingAnswer[T]:
        """``question`` put to the store in the background, unless the breaker refuses it
        (then the answer is that refusal)."""
        try:
            self._admit(what)
        except StoreUnanswered as exc:
            return PendingAnswer(self, None, what, self._clock(), refused=exc)
        return PendingAnswer(self, self._pool.submit(question), what, self._clock())

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


class PendingAnswer(Generic[T]):
    """A question put to the store: :meth:`ready` once answered or late, then :meth:`answer`.
    An answer nobody polls still settles the breaker when it comes (a probe must not keep the
    store counted down because its request went away)."""

    def __init__(
        self,
        guard: StoreGuard,
        future: Future | None,
        what: str,
        asked_at: float,
        refused: StoreUnanswered | None = None,
    ) -> None:
        self.future = future
        self.what = what
        self.asked_at = asked_at
        self._guard = guard
        self._lock = threading.Lock()
        self._outcome: tuple[T | None, StoreUnanswered | None] | None = None
        if refused is not None:
            self._outcome = (None, refused)
        if future is not None:
            future.add_done_callback(lambda _: self._settle())

    def ready(self) -> bool:
        """Whether :meth:`answer` returns or raises without waiting."""
        late = self._guard._clock() - self.asked_at > self._guard.deadline_s
        return self._outcome is not None or self.future.done() or late

    def answer(self) -> T:
        """The store's answer; ``StoreUnanswered`` if it failed, was refused, or has not come
        yet (late: the breaker opens, once). Call when :meth:`ready`."""
        answer, failure = self._settle()
        if failure is not None:
            raise failure
        return answer

    def _settle(self) -> tuple[T | None, StoreUnanswered | None]:
        with self._lock:
            if self._outcome is None:
                self._outcome = self._outcome_now()
            return self._outcome

    def _outcome_now(self) -> tuple[T | None, StoreUnanswered | None]:
        if not self.future.done():
            self._guard._trip()
            ms = round(self._guard.deadline_s * 1000)
            return None, StoreUnanswered(STORE_TIMEOUT, f"{self.what}: no answer within {ms} ms")
        try:
            answer = self.future.result()
        except Exception as exc:  # noqa: BLE001 - any failure of the store is a miss
            self._guard._trip()
            return None, StoreUnanswered(STORE_ERROR, f"{self.what}: {type(exc).__name__}: {exc}")
        self._guard._recovered()
        return answer, None
