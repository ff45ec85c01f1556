"""heap_policy.py: a process that keeps freed memory faults a block's pages in once, not
at each allocation of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# In a fresh process (glibc's thresholds at their defaults): allocate, touch and free a
# 24 MiB block, then do it again, and print the page faults of the second time.
_SCRIPT = """
import ctypes, resource, sys
if sys.argv[1] == "keep":
    from workers.heap_policy import keep_freed_memory
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
size = 24 * 2**20
def touch_once():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
touch_once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch_once()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_touch_faults(mode: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(run.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_freed_block_is_reused_without_faulting_its_pages_in_again():
    pages = 24 * 2**20 // 4096
    # glibc's default gives a block this large a mapping of its own and unmaps it on free.
    assert _second_touch_faults("default") > pages // 2
    assert _second_touch_faults("keep") < pages // 20


def test_setting_it_twice_is_harmless():
    from workers.heap_policy import keep_freed_memory

    first = keep_freed_memory()
    assert keep_freed_memory() == first
