"""Engine outputs multiplexed per router, the replica side: one streamed message per engine
step and router carries every request's new tokens, instead of one Serve stream item per
request and step.

Each Serve stream item costs both processes a fixed amount of CPU (bench/RESULTS.md),
so 32 streams paid it 32 times a step. vLLM v1 splits its engine core from its front end
the same way.

The protocol, per router and engine replica:

- Every `generate` call still goes through Serve: it keeps Serve's replica choice,
  ongoing-request counts, cancellation and errors. Its first item is a `StreamStart`
  saying which replica took it and whether the outputs follow on the call itself or on
  the router's subscription to that replica.
- A router that sees a replica answer "on the call" opens a subscription there: a
  socket to the replica's channel server, whose address the answer carries
  (channel_server.py), or where it cannot connect, one long-lived streaming `subscribe`
  call, pinned to that replica by the request router.
  From then on the replica puts that router's outputs into its `OutputChannel`, and the
  subscription yields what the channel holds, once per wake-up (one engine step, or
  everything that piled up while the router was busy, merged per request).
- A muxed `generate` call stays open until its request's last output is in the channel:
  it ends normally, or raises the request's error, which the router delivers in order.
- A subscription ends when its router has had no muxed request on the replica for
  `idle_s` (a drained replica is thus never held up for long), when either side fails
  (the router then fails the requests it was carrying, and each replica-side pump
  stops), or when its router opens another one to the replica, which takes it over.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from serve_app.protocol import ChannelAddress, StreamStart, Subscription
from serve_app.streaming.output_channel import OutputChannel
from workers.engine import RequestOutput

logger = logging.getLogger(__name__)

# A subscription outlives its last muxed request this long: steady traffic keeps it open,
# a replica being drained or scaled to zero is released soon after its last request.
DEFAULT_IDLE_S = 10.0


@dataclass
class MuxStats:
    """A replica's totals (its stats, for tests and `baton status`)."""

    num_subscriptions: int = 0
    num_muxed_requests: int = 0
    num_batches: int = 0  # subscription items sent
    num_outputs: int = 0  # outputs in them


class OutputChannels:
    """A replica's channels, one per subscribed router."""

    def __init__(self, replica_id: str, idle_s: float = DEFAULT_IDLE_S) -> None:
        if idle_s <= 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.replica_id = replica_id
        self.idle_s = idle_s
        self._channels: dict[str, OutputChannel] = {}
        self.totals = MuxStats()
        # Where routers may subscribe over a socket (channel_server.py), once it listens.
        self.address: ChannelAddress | None = None

    def stats(self) -> dict[str, int]:
        return {**asdict(self.totals), "open_subscriptions": len(self._channels)}

    async def stream(
        self, router_id: str | None, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[StreamStart | RequestOutput]:
        """A generate call's items: its StreamStart, then `outputs` themselves unless the
        router subscribed here, in which case they go to its channel."""
        channel = None if router_id is None else self._channels.get(router_id)
        try:
            if channel is None:
                yield StreamStart(self.replica_id, muxed=False, channel=self.address)
                async for out in outputs:
                    yield out
                return
            channel.num_requests += 1
            self.totals.num_muxed_requests += 1
            try:
                yield StreamStart(self.replica_id, True, channel.subscription_id, self.address)
                async for out in outputs:
                    channel.put(out)
            finally:
                channel.num_requests -= 1
        finally:
            await outputs.aclose()  # now: closing the stream aborts an unfinished request

    async def subscribe(self, sub: Subscription) -> AsyncIterator[str | list[RequestOutput]]:
        """The subscribe call's items: this replica's id (the router checks where the call
        landed), then the router's outputs in batches until the channel is idle."""
        yield self.replica_id
        if sub.replica_id != self.replica_id:
            # Meant for a replica that is gone: the router lets this call go. A channel
            # here would mark this replica's next streams for that router as muxed,
            # on a subscription the router does not have.
            return
        old = self._channels.get(sub.router_id)
        if old is not None:
            if old.subscription_id == sub.subscription_id:
                return  # the same call again: this duplicate just ends
            # The router opens a new subscription only once it has given up the old one;
            # one that failed on its side alone would otherwise hold this channel (and
            # fail the router's muxed streams here) until the channel idled out.
            old.close()
        channel = self._channels[sub.router_id] = OutputChannel(sub.subscription_id)
        self.totals.num_subscriptions += 1
        try:
            while (batch := await channel.next_batch(self.idle_s)) is not None:
                self.totals.num_batches += 1
                self.totals.num_outputs += len(batch)
                yield batch
        finally:
            channel.close()
            if self._channels.get(sub.router_id) is channel:
                del self._channels[sub.router_id]
