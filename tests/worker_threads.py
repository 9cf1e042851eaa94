"""torch's threads in one process of the suite: its share of the cores. The suite runs in
several processes on one machine (pytest-xdist; Makefile: TEST_WORKERS), and torch's default,
a thread per core, has every parallel operation of one process wait for a core that another
process holds: a fit's many small operations then run many times slower than on one core."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def cores_of_this_worker() -> int:
    """This process's share of its cores: all of them outside pytest-xdist."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // workers)


@contextlib.contextmanager
def torch_on_own_cores() -> Iterator[None]:
    """torch on :func:`cores_of_this_worker` threads in the block. Set through torch._C: once a
    process has started an in-process vLLM engine (the connector's tests do), vLLM's CPU
    worker has replaced ``torch.set_num_threads`` with a no-op."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(cores_of_this_worker())
    try:
        yield
    finally:
        torch._C.set_num_threads(before)
