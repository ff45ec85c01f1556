"""Engine outputs multiplexed per router, the router side: one subscription per replica,
and each request's outputs taken from its call or from that subscription (the protocol:
output_channels.py)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from serve_app.errors import SubscriptionLost
from serve_app.protocol import ChannelAddress, StreamStart, Subscription
from serve_app.streaming.socket_subscription import SocketSubscription
from workers.engine import RequestOutput

logger = logging.getLogger(__name__)

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
                self._ensure_subscription(start.replica_id, start.channel)
                async for out in call:
                    yield out
                return
            current = self._subscription_ids.get(start.replica_id)
            if current is None or start.subscription_id not in (None, current):
                if current is None:
                    # The replica still holds a channel this router has given up: a new
                    # subscription takes it over, for the requests after this one.
                    self._ensure_subscription(start.replica_id, start.channel)
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

    def _ensure_subscription(self, replica_id: str, channel: ChannelAddress | None) -> None:
        if replica_id not in self._subscriptions:
            sub = Subscription(self.router_id, replica_id, uuid.uuid4().hex)
            self._subscription_ids[replica_id] = sub.subscription_id
            # In a context of its own, not the request's that opens it: Serve would make
            # the subscribe call a child of that client request and cancel it, with every
            # stream it carries, when that one client leaves.
            run = contextvars.Context().run
            self._subscriptions[replica_id] = run(
                asyncio.ensure_future, self._run_subscription(sub, channel)
            )

    async def _open(self, sub: Subscription, channel: ChannelAddress | None):
        """The subscription: over a socket to the replica's channel server where it has
        one and it answers, else Serve's subscribe call."""
        if channel is not None:
            try:
                return await SocketSubscription.connect(channel, sub)
            except (OSError, asyncio.TimeoutError) as e:
                logger.warning(
                    "cannot reach replica %s's channel server at %s:%d (%s): subscribing "
                    "through Serve", sub.replica_id, channel.host, channel.port, e,
                )  # fmt: skip
        return self._subscribe(sub)

    async def _run_subscription(self, sub: Subscription, channel: ChannelAddress | None) -> None:
        replica_id = sub.replica_id
        error: BaseException = SubscriptionLost(f"the subscription to replica {replica_id} ended")
        call = None
        ended = False  # by the replica: its channel is gone with it
        try:
            call = await self._open(sub, channel)
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
            if not ended and call is not None:
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
