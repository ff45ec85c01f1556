"""torch's intra-op thread count belongs to the OS thread that sets it.

OpenMP keeps the count per thread, so `torch.set_num_threads` in the thread that built
an engine does not reach the thread that steps it (AsyncEngine's engine thread, a Ray
actor's method thread): that one runs at OpenMP's default, every core. Measured on
this 2-core VM, decode at 2 threads ran at half speed that way, and a 1-thread replica
took both cores from its neighbours. Every thread that runs model code sets it here.
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def use_num_threads(num_threads: int) -> None:
    """Sets the calling thread's torch thread count (once per thread and count)."""
    if getattr(_local, "num_threads", None) != num_threads:
        torch.set_num_threads(num_threads)
        _local.num_threads = num_threads
