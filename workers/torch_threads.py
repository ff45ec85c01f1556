"""torch's intra-op thread count belongs to the OS thread that sets it.

OpenMP keeps the count per thread, so `torch.set_num_threads` in the thread that built
an engine does not reach the thread that steps it (AsyncEngine's engine thread, a Ray
actor's method thread): that one runs at OpenMP's default, every core, so a replica
meant to use one core takes them all from its neighbours and threads oversubscribe the
machine. Every thread that runs model code sets it here.

OpenMP's workers also outlive the call that started them, and that matters as much:
libgomp counts every worker it manages in the process, and once they outnumber the
cores, a waiting worker spins ~100 times instead of ~300,000 before it sleeps. An
engine stepped on one thread after its model was loaded on another (AsyncEngine) then
sees its worker fall asleep between each of the hundreds of parallel regions of a
step, and wake through the OS scheduler each time, which slows a batched step
markedly on a machine shared with Serve's serving path. So work that would leave
workers behind on a thread that will not step the engine runs in
`run_in_passing_thread`.

Baton's own kernels take their thread count from here (`kernel_threads`): torch's, but
in a step of a few rows, which runs its matmuls and attention on the kernels' work team
(csrc/work_team.c) and its torch ops (sampling over the vocabulary, say) on one thread
(`kernels_apart`), so that no OpenMP worker spins beside the team's threads after such
an op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")

_local = threading.local()


def use_num_threads(num_threads: int) -> None:
    """Sets the calling thread's torch thread count (once per thread and count)."""
    if getattr(_local, "num_threads", None) != num_threads:
        torch.set_num_threads(num_threads)
        _local.num_threads = num_threads


def kernel_threads() -> int:
    """The calling thread's thread count for Baton's kernels: torch's, but in a
    `kernels_apart` block."""
    return getattr(_local, "kernel_threads", None) or torch.get_num_threads()


@contextmanager
def kernels_apart() -> Iterator[None]:
    """In the block, Baton's kernels keep the calling thread's count and torch's ops run
    on one thread; both are as before after it. Setting torch's count costs well under a
    microsecond."""
    kernels, before = kernel_threads(), torch.get_num_threads()
    _local.kernel_threads = kernels
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        _local.kernel_threads = None


@contextmanager
def one_thread() -> Iterator[None]:
    """torch ops in the block run on the calling thread alone, without a parallel region
    (for short copies, which a region's wait for a descheduled worker would dwarf on a
    busy machine); the thread's count is restored after."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def run_in_passing_thread(fn: Callable[[], T]) -> T:
    """fn() on a thread of its own that then exits, taking with it the OpenMP workers
    that fn's torch ops started (see above); returns fn's result or raises its error."""
    with ThreadPoolExecutor(1, thread_name_prefix="baton-build") as pool:
        return pool.submit(fn).result()
