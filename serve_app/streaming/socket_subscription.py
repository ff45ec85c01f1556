"""A router's output subscription over a socket of its own, the router side (the wire
and why: channel_server.py)."""

from __future__ import annotations

import asyncio
import json
import pickle
from typing import Any

from serve_app.protocol import ChannelAddress, Subscription
from serve_app.streaming.channel_server import FRAME_HEADER

# A replica that has not accepted the connection by then is taken as unreachable.
CONNECT_TIMEOUT_S = 5.0
# The most one frame may hold: a batch of a replica's every running request.
MAX_FRAME_BYTES = 256 * 2**20


class SocketSubscription:
    """The items of a subscription to a replica's channel server, as a Serve subscribe
    call yields them (the replica's id, then batches of outputs); `cancel` ends it on
    both sides. Build it with `connect`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def connect(cls, address: ChannelAddress, sub: Subscription) -> SocketSubscription:
        """Connects and subscribes; OSError (or TimeoutError) if the replica is not
        reachable there."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(address.host, address.port), CONNECT_TIMEOUT_S
        )
        hello = {
            "token": address.token,
            "router_id": sub.router_id,
            "replica_id": sub.replica_id,
            "subscription_id": sub.subscription_id,
        }
        writer.write(json.dumps(hello).encode() + b"\n")
        return cls(reader, writer)

    def cancel(self) -> None:
        self._writer.close()

    def __aiter__(self) -> SocketSubscription:
        return self

    async def __anext__(self) -> Any:
        try:
            header = await self._reader.readexactly(FRAME_HEADER.size)
        except asyncio.IncompleteReadError as e:
            self._writer.close()
            if e.partial:
                raise ConnectionError("the replica's channel closed mid-frame") from None
            raise StopAsyncIteration from None  # the replica ended the subscription
        (size,) = FRAME_HEADER.unpack(header)
        if size > MAX_FRAME_BYTES:
            self._writer.close()
            raise ConnectionError(f"a frame of {size} bytes from the replica's channel")
        # The replica is the one this router's own Serve call named: its pickles are
        # trusted as Serve's are.
        return pickle.loads(await self._reader.readexactly(size))
