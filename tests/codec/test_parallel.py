"""The codec threads (cachegen.codec.coding.parallel): every stream of every job runs once, and none
is left running when a call returns, even when a kernel fails."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from cachegen.codec.coding import parallel


@pytest.fixture(autouse=True)
def two_threads(monkeypatch):
    monkeypatch.setenv("CACHEGEN_CODEC_THREADS", "2")


def test_every_stream_of_every_job_runs_once():
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def kernel(name):
        def run(todo):
            with lock:
                seen.extend((name, int(i)) for i in todo)

        return run

    parallel.run_jobs([(kernel("a"), np.ones(37)), (kernel("b"), np.arange(1.0, 6.0))])
    assert sorted(seen) == sorted([("a", i) for i in range(37)] + [("b", i) for i in range(5)])


def test_a_failing_kernel_leaves_no_batch_running():
    ran: list[int] = []
    lock = threading.Lock()

    def kernel(todo):
        time.sleep(0.002)
        if 0 in todo:
            raise ValueError("a stream does not decode")
        with lock:
            ran.extend(int(i) for i in todo)

    with pytest.raises(ValueError, match="does not decode"):
        parallel.run_batches(kernel, np.ones(16))
    done = len(ran)
    time.sleep(0.05)
    assert len(ran) == done  # nothing ran after the error reached the caller


def test_batches_shrink_to_a_single_stream_at_the_end():
    works = [np.ones(36), np.zeros(0), np.arange(1.0, 9.0)]
    batches = parallel._batches(works, threads=2)
    for j, work in enumerate(works):  # each job's streams, in order, once
        covered = [i for job, todo in batches if job == j for i in todo]
        assert covered == list(range(len(work)))
    sizes = [len(todo) for _, todo in batches]
    assert sizes[0] == max(sizes) > 4  # a quarter of the work, for two threads
    assert sizes[-3:] == [1, 1, 1]  # the last hand-outs are single streams
    assert [len(todo) for _, todo in parallel._batches(works, threads=1)] == [36, 8]
