"""When a decode replica stops asking for direct-transport (nixl) exports for a while.

A direct pull fails when the exporting prefill replica died, or when NIXL/UCX cannot
connect the two processes at all (a network or a pod security policy that blocks it).
The second fails every handoff, and each would cost a second prefill. So after a run of
failed direct pulls a decode replica asks the prefill pool for object-store exports, which
need only Ray's own connections, for a while, then tries the direct transport again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

OBJECT_STORE = "object_store"


class TransportFallback:
    """Consecutive failed direct pulls -> object-store exports for `pause_s`.

    Failures count once per burst: a pull that started before the last counted failure
    shares its cause (a prefill replica that died fails every pull from it at once), so
    only pulls that fail one after another, each started after the last failed, add up."""

    def __init__(
        self,
        failures_to_pause: int = 3,
        pause_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures_to_pause < 1:
            raise ValueError(f"failures_to_pause must be >= 1, got {failures_to_pause}")
        if not pause_s > 0:
            raise ValueError(f"pause_s must be > 0, got {pause_s!r}")
        self.failures_to_pause, self.pause_s, self._clock = failures_to_pause, pause_s, clock
        self._failures = 0  # direct pulls failed in a row
        self._last_failure_at = float("-inf")
        self._paused_until = 0.0
        self.num_pauses = 0

    def transport(self) -> str | None:
        """The transport to ask the prefill pool for: None (the pool's own) unless direct
        pulls are paused."""
        return OBJECT_STORE if self._clock() < self._paused_until else None

    def direct_pull_failed(self, cause: BaseException, started_at: float) -> None:
        """A direct pull that began at `started_at` (this object's clock) failed."""
        if started_at < self._last_failure_at:
            return  # the same burst as a failure already counted
        self._last_failure_at = self._clock()
        self._failures += 1
        if self._failures < self.failures_to_pause:
            return
        self._failures = 0
        self._paused_until = self._clock() + self.pause_s
        self.num_pauses += 1
        logger.warning(
            "%d direct KV pulls failed in a row (last: %s: %s); asking for object-store "
            "exports for %.0f s",
            self.failures_to_pause,
            type(cause).__name__,
            cause,
            self.pause_s,
        )

    def direct_pull_succeeded(self) -> None:
        self._failures = 0

    def now(self) -> float:
        return self._clock()
