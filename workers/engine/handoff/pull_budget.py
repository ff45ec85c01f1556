"""A byte budget for handoff KV pulled ahead of its import.

A decode engine pulls a handoff's KV as soon as the request arrives (off the engine
thread, so transfers overlap steps), but imports it only once its cache has free
blocks. Under a burst, requests pile up between the two, each holding its pulled KV
outside the block budget. `PullBudget` makes further pulls wait, in arrival order,
until imports have made room, so that memory stays within `capacity` bytes. A pull
larger than the whole budget still goes, alone, rather than never.

Callers may sit on different event loops (an AsyncEngine serves any loop), so waiters
are woken with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass


@dataclass(eq=False)
class _Waiter:
    nbytes: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    granted: bool = False


class PullBudget:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 byte, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._used = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def used(self) -> int:
        """Bytes granted and not yet released."""
        return self._used

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, nbytes: int) -> None:
        """Returns once `nbytes` are granted (release them with `release`). Cancelled while
        waiting, it takes nothing."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiters and self._fits(nbytes):
                self._used += nbytes
                return
            waiter = _Waiter(nbytes, loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            with self._lock:
                if waiter.granted:  # granted as the cancel arrived: give it back
                    self._used -= nbytes
                else:
                    self._waiters.remove(waiter)
                self._grant()  # whoever waited behind it may fit now
            raise

    def release(self, nbytes: int) -> None:
        """Gives back bytes `acquire` granted; any thread."""
        with self._lock:
            if nbytes > self._used:
                raise RuntimeError(f"releasing {nbytes} bytes, only {self._used} are granted")
            self._used -= nbytes
            self._grant()

    def _fits(self, nbytes: int) -> bool:
        return self._used == 0 or self._used + nbytes <= self.capacity

    def _grant(self) -> None:
        # First in, first served: a large pull at the head is not starved by small ones.
        while self._waiters and self._fits(self._waiters[0].nbytes):
            waiter = self._waiters.popleft()
            waiter.granted = True
            self._used += waiter.nbytes
            try:
                waiter.loop.call_soon_threadsafe(_wake, waiter.future)
            except RuntimeError:  # its loop is closed: nobody will release these bytes
                self._used -= waiter.nbytes


def _wake(future: asyncio.Future) -> None:
    if not future.done():  # cancelled meanwhile: acquire's handler gave the bytes back
        future.set_result(None)
