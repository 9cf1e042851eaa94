"""Spread independent coder streams over CPU threads.

The numba kernels release the GIL, so plain threads give real parallelism. Streams are
split into contiguous batches that shrink as the work left does (guided scheduling): the
first few are large, so the threads take few hand-outs, and the last are single streams, so
they run out of work together; the calling thread takes batches too.
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
    batches = _batches([work for _, work in jobs], threads)
    pending = iter([(jobs[j][0], todo) for j, todo in batches])  # shared: atomic under the GIL

    def drain() -> None:
        for kernel, todo in pending:
            kernel(todo)

    helpers = [_executor(threads - 1).submit(drain) for _ in range(min(threads, len(batches)) - 1)]
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


def _batches(works: list[np.ndarray], threads: int) -> list[tuple[int, np.ndarray]]:
    """``(job, stream indices)`` batches covering every job's streams in order. Each batch
    takes about ``1 / (2 threads)`` of the work left: the first are large (few hand-outs),
    the last single streams, so the threads run out of work together."""
    sizes = np.array([len(work) for work in works], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    count = int(starts[-1])
    cum = np.cumsum(np.concatenate([np.zeros(0), *works]), dtype=np.float64)
    bounds = starts
    if threads > 1 and count and cum[-1] > 0:
        keep = 1 - 1 / (2 * threads)
        left = keep ** np.arange(1, int(np.ceil(np.log(count) / -np.log(keep))) + 1)
        edges = np.searchsorted(cum, cum[-1] * (1 - left)) + 1
        bounds = np.unique(np.concatenate([starts, np.minimum(edges, count)]))
    jobs = np.searchsorted(starts, bounds[:-1], side="right") - 1
    return [
        (int(j), np.arange(a - starts[j], b - starts[j], dtype=np.int64))
        for j, a, b in zip(jobs, bounds[:-1], bounds[1:])
        if b > a
    ]
