"""Spread independent coder streams over CPU threads.

The numba kernels release the GIL, so plain threads give real parallelism. Streams are
split into contiguous batches of about equal work (symbols), a few per thread so a slow
core does not hold everyone up; the calling thread takes batches too.
``CACHEGEN_CODEC_THREADS`` overrides the thread count (default: the CPUs this process may
run on).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def num_threads() -> int:
    explicit = os.environ.get("CACHEGEN_CODEC_THREADS")
    if explicit:
        try:
            return max(1, int(explicit))
        except ValueError:
            pass
    return max(1, len(os.sched_getaffinity(0)))


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers != threads:
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cachegen-codec")
        return _pool


def run_batches(kernel: Callable[[np.ndarray], None], work: np.ndarray) -> None:
    """Call ``kernel(todo)`` on batches of stream indices covering ``range(len(work))``.

    ``work[i]`` is the relative cost of stream ``i``.
    """
    run_jobs([(kernel, work)])


def run_jobs(jobs: list[tuple[Callable[[np.ndarray], None], np.ndarray]]) -> None:
    """:func:`run_batches` for several ``(kernel, work)`` jobs at once (the frames of a
    bitstream): one hand-out of batches for all of them, so threads wait once, not once per
    job. The calling thread works too instead of waiting."""
    threads = num_threads()
    total = sum(float(np.sum(work)) for _, work in jobs)
    tasks = []
    for kernel, work in jobs:
        share = float(np.sum(work)) / total if total else 1.0
        parts = max(1, round(_BATCHES_PER_THREAD * threads * share)) if threads > 1 else 1
        tasks += [(kernel, todo) for todo in _split(work, parts)]
    pending = iter(tasks)  # shared: each thread takes the next batch (atomic under the GIL)

    def drain() -> None:
        for kernel, todo in pending:
            kernel(todo)

    helpers = [_executor(threads - 1).submit(drain) for _ in range(min(threads, len(tasks)) - 1)]
    try:
        drain()
    finally:
        # none may still write once this returns, even on an error; a helper that has not
        # started has nothing left to do (and may be queued behind this very thread)
        started = [future for future in helpers if not future.cancel()]
        for future in started:
            future.exception()
    for future in started:
        future.result()


_BATCHES_PER_THREAD = 4  # a few per thread, so a slow core does not hold everyone up


def _split(work: np.ndarray, parts: int) -> list[np.ndarray]:
    """Contiguous ranges of stream indices of about equal ``work``, at most ``parts``."""
    count = len(work)
    parts = min(parts, count)
    if parts <= 1:
        return [np.arange(count, dtype=np.int64)] if count else []
    edges = np.searchsorted(
        np.cumsum(work, dtype=np.float64), np.linspace(0, float(np.sum(work)), parts + 1)[1:-1]
    )
    bounds = np.unique(np.concatenate([[0], edges, [count]]))
    return [np.arange(a, b, dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
