"""A model process keeps the memory its steps free, rather than hand it back to the OS.

A step allocates and frees tensors of megabytes: a 512-token prefill's activations
(6 MB for SmolLM2's gate and up projections) and a handoff's exported blocks (24 MB
for 512 tokens). glibc serves a block that large with its own mapping, or from the top
of a heap it then trims, and either way returns it to the OS when it is freed; the next
step's block of the same size then faults its pages in again, one 4 KiB page at a time,
and each fault zeroes a page in the kernel. Measured on a prefill replica, that was
8,500 to 14,000 faults per 512-token prompt, some tens of milliseconds of system time.

`keep_freed_memory` raises glibc's mapping threshold to its maximum (32 MiB) and its
trim threshold out of reach, so blocks up to 32 MiB come from the heap and go back to
it: a process's heap stays at its largest step's size, as a caching allocator's
(tcmalloc, jemalloc, which vLLM's CPU images preload) would. Larger blocks keep their
own mappings. Where the C library is not glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mapping threshold glibc takes on 64-bit systems (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD = 32 * 2**20
# Free memory at the top of a heap goes back to the OS only past this (mallopt takes an
# int): never, for any heap here.
TRIM_THRESHOLD = 2**31 - 1

_done = False


def keep_freed_memory() -> bool:
    """Sets this process's allocator to keep freed blocks of up to 32 MiB (once per
    process). Whether the allocator took the settings (False off glibc)."""
    global _done
    if _done:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this process's C library: its allocator is left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    _done = ok
    return ok
