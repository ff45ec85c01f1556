"""A replica's output subscriptions over sockets of their own, the replica side.

A subscription that is a Serve call crosses Serve's machinery with every batch: on the
replica a hop from the user code's event loop to the actor's, a gRPC stream and its
poller; on the router the handle's event loop, then another hop to the router's own.
A single stream paid that every token, on the cores its engine steps on. Here a router
connects to the replica's `ChannelServer` instead (its address rides on `StreamStart`)
and the same subscription (`OutputChannels.subscribe`) writes its items straight to the
socket, from the event loop that fills the channel; the router reads them on its own
loop (socket_subscription.py). Serve still carries every `generate` call, and a router
that cannot connect subscribes through Serve as before.

The wire: the router sends one line of JSON (its `Subscription` and the replica's
token, which only a caller of the replica's `generate` learns); the replica then sends
frames of a 4-byte big-endian length and a pickle of one item, and closes the socket
when the subscription ends. The router closing its end ends the subscription here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import secrets
import struct

from serve_app.protocol import ChannelAddress, Subscription
from serve_app.streaming.output_channels import OutputChannels

logger = logging.getLogger(__name__)

FRAME_HEADER = struct.Struct("!I")
# A connection that says nothing within this long is dropped.
HELLO_TIMEOUT_S = 10.0
MAX_HELLO_BYTES = 4096


class ChannelServer:
    """Takes the subscriptions of `channels` over TCP on `host`, on a port of the OS's
    choosing. `start` on the event loop that fills the channels (asyncio's objects are
    that loop's)."""

    def __init__(self, channels: OutputChannels, host: str) -> None:
        self.channels = channels
        self.host = host
        self._token = secrets.token_hex(16)
        self._server: asyncio.Server | None = None
        self._starting: asyncio.Future | None = None

    async def start(self) -> ChannelAddress | None:
        """The server's address, listening from the first call on; None if it could not
        listen (routers then subscribe through Serve)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._listen())
        elif self._starting.done():  # every call after the first: no new future
            return self._starting.result()
        return await asyncio.shield(self._starting)

    async def _listen(self) -> ChannelAddress | None:
        try:
            self._server = await asyncio.start_server(
                self._serve, self.host, 0, limit=MAX_HELLO_BYTES
            )
        except OSError as e:
            logger.warning(
                "cannot listen for output subscriptions on %s (%s): routers subscribe "
                "through Serve", self.host, e,
            )  # fmt: skip
            return None
        port = self._server.sockets[0].getsockname()[1]
        address = ChannelAddress(self.host, port, self._token)
        self.channels.address = address
        logger.info("output subscriptions on %s:%d", self.host, port)
        return address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sub = await self._hello(reader)
            if sub is not None:
                await self._send(sub, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the router went: its channel is closed already
        except Exception:  # the router sees the socket close and fails the requests
            logger.exception("an output subscription failed on this replica")
        finally:
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader) -> Subscription | None:
        try:
            line = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
            hello = json.loads(line)
            if not secrets.compare_digest(str(hello["token"]), self._token):
                logger.warning("a subscription with a wrong token was refused")
                return None
            return Subscription(
                str(hello["router_id"]), str(hello["replica_id"]), str(hello["subscription_id"])
            )
        except (ValueError, KeyError, TypeError, asyncio.TimeoutError) as e:
            logger.warning("a malformed subscription was refused: %r", e)
            return None

    async def _send(
        self, sub: Subscription, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """The subscription's items to the socket until either side ends it."""
        items = self.channels.subscribe(sub)

        async def pump() -> None:
            async for item in items:
                payload = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
                writer.write(FRAME_HEADER.pack(len(payload)) + payload)
                await writer.drain()

        sending = asyncio.ensure_future(pump())
        gone = asyncio.ensure_future(reader.read(1))  # the router sends nothing more
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
            if sending.done():
                sending.result()  # a failure to write is the router's going
        finally:
            sending.cancel()
            gone.cancel()
            await asyncio.gather(sending, gone, return_exceptions=True)
            await items.aclose()  # closes the channel: its muxed streams fail, not wait
