"""Engine outputs multiplexed per router: one streamed message per engine step and router
carries every request's new tokens, instead of one Serve stream item per request and step.

Each Serve stream item costs both processes a fixed amount of CPU (measured at about
0.6 ms of the engine's time on a 2-core machine, where the router shares its cores), so
32 streams paid it 32 times a step. vLLM v1 splits its engine core from its front end the
same way.

The protocol, per router and engine replica:

- Every `generate` call still goes through Serve: it keeps Serve's replica choice,
  ongoing-request counts, cancellation and errors. Its first item is a `StreamStart`
  saying which replica took it and whether the outputs follow on the call itself or on
  the router's subscription to that replica.
- A router that sees a replica answer "on the call" opens a subscription there: one
  long-lived streaming `subscribe` call, pinned to that replica by the request router.
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

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass

from serve_app.protocol import StreamStart, Subscription
from workers.engine import RequestOutput, merge_outputs

logger = logging.getLogger(__name__)

# A subscription outlives its last muxed request this long: steady traffic keeps it open,
# a replica being drained or scaled to zero is released soon after its last request.
DEFAULT_IDLE_S = 10.0


class SubscriptionLost(RuntimeError):
    """The router's subscription to a replica ended while it carried this request."""


# -- replica side ------------------------------------------------------------------


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
                yield StreamStart(self.replica_id, muxed=False)
                async for out in outputs:
                    yield out
                return
            channel.num_requests += 1
            self.totals.num_muxed_requests += 1
            try:
                yield StreamStart(self.replica_id, True, channel.subscription_id)
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


# -- router side -------------------------------------------------------------------

_GENERATE_ENDED = object()


class OutputDemux:
    """A router's subscriptions, one per replica it has sent requests to, and the queue of
    each of its requests whose outputs come through one."""

    def __init__(self, subscribe: Callable[[Subscription], AsyncIterator]) -> None:
        # `subscribe(sub)`: the pool's subscribe call, pinned to `sub.replica_id`.
        self.router_id = uuid.uuid4().hex
        self._subscribe = subscribe
        self._subscriptions: dict[str, asyncio.Task] = {}
        self._subscription_ids: dict[str, str] = {}  # replica id -> its subscription's
        self._queues: dict[str, tuple[str, asyncio.Queue]] = {}  # request id -> replica, queue

    @property
    def num_requests(self) -> int:
        """Requests whose outputs this demux is waiting for."""
        return len(self._queues)

    @property
    def subscribed(self) -> set[str]:
        """The replicas this router has (or is opening) a subscription to."""
        return set(self._subscriptions)

    async def outputs(
        self, request_id: str, call: AsyncIterator[StreamStart | RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        """A generate call's outputs, from the call itself or from the subscription."""
        queue: asyncio.Queue = asyncio.Queue()
        # Registered before the first item: muxed outputs may overtake the StreamStart.
        self._queues[request_id] = ("", queue)
        try:
            start = await anext(call)
            if not isinstance(start, StreamStart):
                raise RuntimeError(f"a generate call began with {type(start).__name__}")
            if not start.muxed:
                del self._queues[request_id]
                self._ensure_subscription(start.replica_id)
                async for out in call:
                    yield out
                return
            current = self._subscription_ids.get(start.replica_id)
            if current is None or start.subscription_id not in (None, current):
                if current is None:
                    # The replica still holds a channel this router has given up: a new
                    # subscription takes it over, for the requests after this one.
                    self._ensure_subscription(start.replica_id)
                # Its outputs went to a subscription that has ended: they are lost.
                raise SubscriptionLost(f"no subscription to replica {start.replica_id}")
            self._queues[request_id] = (start.replica_id, queue)
            watcher = asyncio.ensure_future(_watch_end(call, queue))
            finished = False
            try:
                while not finished:
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item is _GENERATE_ENDED:
                        continue  # the last output is still on its way (subscription)
                    finished = item.finished
                    yield item
            finally:
                if not finished:  # else the call ends by itself, right after its output
                    watcher.cancel()
        finally:
            self._queues.pop(request_id, None)

    def _ensure_subscription(self, replica_id: str) -> None:
        if replica_id not in self._subscriptions:
            sub = Subscription(self.router_id, replica_id, uuid.uuid4().hex)
            self._subscription_ids[replica_id] = sub.subscription_id
            # In a context of its own, not the request's that opens it: Serve would make
            # the subscribe call a child of that client request and cancel it, with every
            # stream it carries, when that one client leaves.
            run = contextvars.Context().run
            self._subscriptions[replica_id] = run(
                asyncio.ensure_future, self._run_subscription(sub)
            )

    async def _run_subscription(self, sub: Subscription) -> None:
        replica_id = sub.replica_id
        error: BaseException = SubscriptionLost(f"the subscription to replica {replica_id} ended")
        call = self._subscribe(sub)
        ended = False  # by the replica: its channel is gone with it
        try:
            if await anext(call) != replica_id:
                return  # pinned to a replica that is gone: a later request there retries
            async for batch in call:
                for out in batch:
                    entry = self._queues.get(out.request_id)
                    if entry is not None:
                        entry[1].put_nowait(out)
            ended = True
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.warning("output subscription to replica %s failed: %s", replica_id, e)
            error = SubscriptionLost(f"the subscription to replica {replica_id} failed: {e}")
        finally:
            if not ended:
                # Whatever broke on this side, the replica must drop its channel too, so
                # that it stops sending this router's outputs where nobody reads them.
                call.cancel()
            del self._subscriptions[replica_id], self._subscription_ids[replica_id]
            for replica, queue in self._queues.values():
                if replica == replica_id:
                    queue.put_nowait(error)

    def close(self) -> None:
        for task in list(self._subscriptions.values()):
            task.cancel()


async def _watch_end(call: AsyncIterator, queue: asyncio.Queue) -> None:
    """Waits out a muxed generate call: its end, or its error, joins the request's queue."""
    try:
        async for item in call:
            raise RuntimeError(f"a muxed generate call sent {type(item).__name__}")
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        queue.put_nowait(e)
        return
    queue.put_nowait(_GENERATE_ENDED)
