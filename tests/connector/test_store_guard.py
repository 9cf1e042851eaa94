"""The deadline and the breaker around the scheduler's store questions (StoreGuard), with a
clock the test moves: a late answer or an error is a miss and opens the breaker, a store
counted down is not asked, and one probe at a time finds it back."""

from __future__ import annotations

import threading
import time

import pytest

from cachegen.connector.store_guard import (
    STORE_DOWN,
    STORE_ERROR,
    STORE_TIMEOUT,
    StoreGuard,
    StoreUnanswered,
)
from cachegen.store import StoreUnavailable

DEADLINE_S = 0.05
BACKOFF_S = 10.0


@pytest.fixture
def clock():
    now = [0.0]
    return now


@pytest.fixture
def guard(clock):
    guard = StoreGuard(DEADLINE_S, BACKOFF_S, clock=lambda: clock[0])
    yield guard
    guard.close()


def _refused(guard: StoreGuard, question) -> StoreUnanswered:
    with pytest.raises(StoreUnanswered) as refused:
        guard.ask(question, "lookup")
    return refused.value


def test_a_late_answer_is_a_miss_and_the_store_is_not_asked_until_the_back_off_ends(guard, clock):
    release = threading.Event()
    late = _refused(guard, release.wait)
    assert late.reason == STORE_TIMEOUT and "no answer within 50 ms" in str(late)
    asked = []
    clock[0] = BACKOFF_S - 0.1
    down = _refused(guard, lambda: asked.append(1))
    assert down.reason == STORE_DOWN and not asked and guard.down
    release.set()
    clock[0] = BACKOFF_S  # the back-off is over: the next question probes, and answers
    assert guard.ask(lambda: 7, "lookup") == 7
    assert not guard.down and guard.ask(lambda: 8, "lookup") == 8


def test_an_error_opens_the_breaker_and_one_probe_at_a_time_goes_out(clock):
    guard = StoreGuard(5.0, BACKOFF_S, clock=lambda: clock[0])  # a probe stays out till released

    def failing():
        raise StoreUnavailable("redis at 127.0.0.1:1 is unreachable")

    try:
        error = _refused(guard, failing)
        assert error.reason == STORE_ERROR and "unreachable" in str(error)
        clock[0] = BACKOFF_S
        probe_asked, release = threading.Event(), threading.Event()

        def probe():
            probe_asked.set()
            release.wait()
            return 1

        answers: list = []
        prober = threading.Thread(target=lambda: answers.append(guard.ask(probe, "lookup")))
        prober.start()
        assert probe_asked.wait(5)
        second = _refused(guard, lambda: 2)  # while the probe is out
        assert second.reason == STORE_DOWN and "probe" in str(second)
        release.set()
        prober.join()
        assert answers == [1] and not guard.down  # the probe's answer closes the breaker
        assert guard.ask(lambda: 3, "lookup") == 3
    finally:
        guard.close()


def test_a_submitted_question_never_waits_and_its_answer_is_read_on_a_later_step(guard, clock):
    release = threading.Event()
    pending = guard.submit(lambda: release.wait() and 5, "lookup")
    assert not pending.ready()  # asked: the step goes on without the answer
    release.set()
    pending.future.result(timeout=5)
    assert pending.ready() and pending.answer() == 5 and not guard.down


def test_an_answer_not_come_by_the_deadline_is_a_miss_and_opens_the_breaker(guard, clock):
    release = threading.Event()
    pending = guard.submit(release.wait, "lookup")
    clock[0] = DEADLINE_S * 2  # a later step: the deadline has passed
    assert pending.ready()
    with pytest.raises(StoreUnanswered) as late:
        pending.answer()
    release.set()
    assert late.value.reason == STORE_TIMEOUT and guard.down
    refused = guard.submit(lambda: 1, "lookup")  # counted down: answered at once, not asked
    assert refused.future is None and refused.ready()
    with pytest.raises(StoreUnanswered, match="counted down"):
        refused.answer()


def test_a_probe_nobody_polls_still_brings_the_store_back(guard, clock):
    _refused(guard, lambda: (_ for _ in ()).throw(StoreUnavailable("down")))
    clock[0] = BACKOFF_S
    probe = guard.submit(lambda: 1, "lookup")  # its request goes away before the next step
    probe.future.result(timeout=5)
    for _ in range(500):  # the future's callback settles the breaker just after its result
        if not guard.down:
            break
        time.sleep(0.01)
    assert not guard.down and guard.ask(lambda: 2, "lookup") == 2
