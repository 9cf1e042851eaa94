"""Spread independent coder streams over CPU threads.

The numba kernels release the GIL, so plain threads give real parallelism. Streams are
split into contiguous batches of about equal work (symbols), a few per thread so a slow
core does not hold everyone up. ``CACHEGEN_CODEC_THREADS`` overrides the thread count
(default: the CPUs this process may run on).
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
    count = len(work)
    threads = min(num_threads(), count)
    if threads <= 1:
        kernel(np.arange(count, dtype=np.int64))
        return
    batches = min(count, 4 * threads)
    edges = np.searchsorted(
        np.cumsum(work, dtype=np.float64), np.linspace(0, float(np.sum(work)), batches + 1)[1:-1]
    )
    bounds = np.unique(np.concatenate([[0], edges, [count]]))
    todo = [np.arange(a, b, dtype=np.int64) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    for future in [_executor(threads).submit(kernel, t) for t in todo]:
        future.result()
