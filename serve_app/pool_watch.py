"""What Serve's controller says of this application's pools: running replicas per
deployment, for health checks, `GetModelInfo` and a decode replica's degraded mode (it
prefills new requests itself while the prefill pool has no running replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

from ray import serve
from ray.serve.context import _get_global_client

# How long an answer of the controller is used before it is asked again.
REFRESH_S = 1.0


def running_replicas() -> dict[str, int]:
    """Running replicas per deployment of this replica's application (blocks on a call
    to Serve's controller: run it off the event loop).

    Read from the controller's plain answer: `serve.status()` validates the same answer
    into pydantic models, which cloudpickles each deployment's request router class,
    several times the CPU, taken from the engines' cores while requests come."""
    app = serve.get_replica_context().app_name
    details = _get_global_client().get_serve_details()
    deployments = details.get("applications", {}).get(app, {}).get("deployments", {})
    return {
        name: sum(r["state"] == "RUNNING" for r in d.get("replicas", ()))
        for name, d in deployments.items()
    }


class PoolWatch:
    """This application's running replicas per deployment, and whether one deployment has
    any, as the controller last said. Reading never waits: it returns the last answer
    and, when that is older than REFRESH_S, asks again on a thread of its own."""

    def __init__(self, deployment: str) -> None:
        self.deployment = deployment
        self._counts: dict[str, int] | None = None
        self._asked_at = -REFRESH_S
        self._pending: Future | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pool-watch")

    def counts(self) -> dict[str, int] | None:
        """Running replicas per deployment; None until the controller first answers. While
        it cannot be asked, its last answer stands."""
        if self._pending is None and time.monotonic() - self._asked_at > REFRESH_S:
            self._ask()
        return self._counts

    def has_running(self) -> bool:
        """Whether `deployment` has a running replica. Until the first answer it counts as
        running (its calls then fail or wait as they would without the watch)."""
        counts = self.counts()
        return counts is None or counts.get(self.deployment, 0) > 0

    async def refreshed(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for an answer asked now (or already on its way), for a
        caller about to act on "none running": the last answer may be from before the pool
        started (a replica reads the watch while its application deploys). If none comes
        in time, the last answer stands."""
        pending = self._pending or self._ask()
        # Timed out, or the controller failed: as in counts(), the last answer stands.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending)), timeout_s)

    def _ask(self) -> Future:
        self._asked_at = time.monotonic()
        self._pending = self._thread.submit(running_replicas)
        self._pending.add_done_callback(self._answered)
        return self._pending

    def _answered(self, answer: Future) -> None:
        self._pending = None
        if answer.exception() is None:
            self._counts = answer.result()
