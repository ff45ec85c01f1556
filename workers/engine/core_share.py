"""The machine's cores, shared step by step among the engines that run on it.

A prefill and a decode replica on one machine are rarely busy at once for long: a
single stream decodes while prefill is idle, and a burst of prompts prefills while
decode waits. A fixed thread count per replica leaves cores idle in the first case or,
set to every core, makes two busy replicas' thread teams contend for them (their
parallel regions wait on a descheduled worker). So an engine with threads "auto"
takes, at each step it has work for, its share of the cores: all of them while it is
the only busy engine on the machine, an even split while others are busy too, never
less than one.

The engines on a machine (of any application) find one another in a small table in
shared memory, `/dev/shm/baton-cores`: a slot per engine process holding its pid and
whether it is busy. An engine marks itself busy when it steps with work and idle when
it runs out; the busy slots of live processes are counted at each step (a killed
replica's slot counts no more). Containers (a Kubernetes pod) have their own /dev/shm
and their own cores, so each shares within itself.
"""

from __future__ import annotations

import fcntl
import logging
import math
import mmap
import os
import struct
import weakref
from pathlib import Path

log = logging.getLogger(__name__)

TABLE_PATH = Path("/dev/shm/baton-cores")
NUM_SLOTS = 64
_SLOT = struct.Struct("<qq")  # pid, busy (0 or 1)
_BUSY = struct.Struct("<q")  # a slot's second field


def machine_cores() -> int:
    """The cores this process may run on: its CPU affinity, bounded by a cgroup v2 CPU
    quota where one is set (a container's CPU limit)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(1, min(cores, math.ceil(int(quota) / int(period))))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _release(table: mmap.mmap, slot: int) -> None:
    _SLOT.pack_into(table, slot * _SLOT.size, 0, 0)
    table.close()


class TableFullError(Exception):
    """Every slot of the table is held by a live engine."""


class CoreShare:
    """This process's slot in the machine's table; `threads()` at each busy step, `idle()`
    when the engine runs out of work. Where the table cannot be used (no /dev/shm, every
    slot held) the engine steps on one thread, with a warning."""

    def __init__(self, cores: int | None = None, path: Path = TABLE_PATH):
        self.cores = cores or machine_cores()
        self.pid = os.getpid()
        self._busy = False
        self._table: mmap.mmap | None = None
        try:
            self._table, self._slot = self._join(path)
        except (OSError, TableFullError) as e:
            # Alone, it cannot know who else is busy: one thread, as before "auto".
            log.warning("cannot share the machine's cores (%s); this engine steps on one thread", e)
            return
        # Given back when the engine is shut down or, failing that, collected.
        self._release = weakref.finalize(self, _release, self._table, self._slot)

    def _join(self, path: Path) -> tuple[mmap.mmap, int]:
        """The table, mapped, and a free slot in it (never claimed, or its process gone)
        marked with this pid. Two engines in one process hold two slots."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            # One claimer at a time. Unlocked explicitly: the mapping keeps a duplicate of
            # the descriptor, and with it the lock, past the close.
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size < NUM_SLOTS * _SLOT.size:
                os.ftruncate(fd, NUM_SLOTS * _SLOT.size)
            table = mmap.mmap(fd, NUM_SLOTS * _SLOT.size)
            for slot in range(NUM_SLOTS):
                pid, _ = _SLOT.unpack_from(table, slot * _SLOT.size)
                if pid == 0 or (pid != self.pid and not _alive(pid)):
                    _SLOT.pack_into(table, slot * _SLOT.size, self.pid, 0)
                    return table, slot
            table.close()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        raise TableFullError(
            f"every one of the {NUM_SLOTS} slots in {path} is held by a live engine; set "
            "the engines' thread counts instead of 'auto'"
        )

    def threads(self) -> int:
        """Marks this engine busy; the threads its step may use: the cores split among
        the busy engines, at least one."""
        if self._table is None:
            return 1
        if not self._busy:
            self._set_busy(True)
        busy = 0
        for slot in range(NUM_SLOTS):
            pid, flag = _SLOT.unpack_from(self._table, slot * _SLOT.size)
            if flag and (pid == self.pid or _alive(pid)):
                busy += 1
        return max(1, self.cores // max(busy, 1))

    def idle(self) -> None:
        """Marks this engine idle: the others may take its cores."""
        if self._busy:
            self._set_busy(False)

    def close(self) -> None:
        """Gives the slot back (once; later calls do nothing)."""
        if self._table is not None:
            self._release()

    def _set_busy(self, busy: bool) -> None:
        _BUSY.pack_into(self._table, self._slot * _SLOT.size + 8, int(busy))
        self._busy = busy
