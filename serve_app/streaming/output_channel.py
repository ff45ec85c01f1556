"""One router's outputs waiting on a replica for that router's subscription to carry them
(the protocol: output_channels.py)."""

from __future__ import annotations

import asyncio

from serve_app.errors import SubscriptionLost
from workers.engine import RequestOutput, merge_outputs


class OutputChannel:
    """One router's outputs on one replica, waiting for its subscription to send them."""

    def __init__(self, subscription_id: str | None = None) -> None:
        self.subscription_id = subscription_id
        self._pending: dict[str, list[RequestOutput]] = {}
        self._ready = asyncio.Event()
        self.num_requests = 0  # muxed requests still producing outputs
        self.closed = False

    def put(self, out: RequestOutput) -> None:
        if self.closed:
            raise SubscriptionLost("the router's output subscription to this replica ended")
        self._pending.setdefault(out.request_id, []).append(out)
        self._ready.set()

    def close(self) -> None:
        """Ends the channel: its subscription's next wait returns None, and its muxed
        streams' next outputs fail (their router has already failed their requests)."""
        self.closed = True
        self._ready.set()

    async def next_batch(self, idle_s: float) -> list[RequestOutput] | None:
        """Everything pending, one output per request; None once the channel has been idle
        (no pending output, no muxed request) for `idle_s`, or has been closed."""
        while not self._pending:
            if self.closed:
                return None
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), idle_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before 3.11
                if self.num_requests == 0 and not self._pending:
                    return None
        pending, self._pending = self._pending, {}
        return [outs[0] if len(outs) == 1 else merge_outputs(outs) for outs in pending.values()]
