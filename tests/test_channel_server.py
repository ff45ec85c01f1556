"""Output subscriptions over a socket (serve_app/streaming/channel_server.py and
socket_subscription.py): the replica's channels behind a real TCP server on localhost,
the router's demux connecting to it, Serve's subscribe call (output_mux_helpers.py)
left for the fallback."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from output_mux_helpers import Service, _collect, _eventually, _tokens

from serve_app.errors import SubscriptionLost
from serve_app.protocol import ChannelAddress, StreamStart
from serve_app.streaming.channel_server import ChannelServer


async def _socket_service(idle_s: float = 10.0) -> tuple[Service, ChannelServer]:
    svc = Service(idle_s=idle_s)
    server = ChannelServer(svc.channels, "127.0.0.1")
    await server.start()
    return svc, server


def test_later_requests_share_a_subscription_over_the_socket_not_a_serve_call():
    async def main():
        svc, server = await _socket_service()
        call, outputs = svc.request("r0")
        start = await anext(call)
        assert isinstance(start, StreamStart) and not start.muxed
        assert start.channel == svc.channels.address and start.channel.host == "127.0.0.1"
        await svc.engine.wait_for("r0")
        svc.engine.step(1, finish=True)
        # The demux reads the start itself: a second request shows the first's effect.
        assert await svc.run_alone("r1", 2) == [2]
        await svc.subscribed()

        rids = ["a", "b", "c"]
        tasks = [asyncio.ensure_future(_collect(svc.request(r)[1])) for r in rids]
        await svc.engine.wait_for(*rids)
        for token in (3, 4):
            svc.engine.step(token)
        svc.engine.step(5, finish=True)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert [_tokens(r) for r in results] == [[3, 4, 5]] * 3
        assert svc.subscriptions == []  # no Serve subscribe call was made
        assert svc.channels.stats()["num_muxed_requests"] == 3
        svc.demux.close()
        await _eventually(lambda: svc.channels.stats()["open_subscriptions"] == 0)
        server.close()

    asyncio.run(main())


def test_a_router_that_leaves_closes_its_channel_and_the_muxed_streams_fail():
    async def main():
        svc, server = await _socket_service()
        await svc.run_alone("warm", 1)
        await svc.subscribed()
        call, outputs = await svc.decoding("carried")
        svc.demux.close()  # the router's socket closes
        with pytest.raises(SubscriptionLost):
            await anext(outputs)
        await _eventually(lambda: svc.channels.stats()["open_subscriptions"] == 0)
        call.cancel()
        await _eventually(lambda: "carried" in svc.engine.closed)
        server.close()

    asyncio.run(main())


def test_an_idle_channel_ends_the_socket_and_the_next_request_subscribes_anew():
    async def main():
        svc, server = await _socket_service(idle_s=0.05)
        await svc.run_alone("r0", 1)
        await svc.subscribed()
        await _eventually(lambda: svc.channels.stats()["open_subscriptions"] == 0)
        await _eventually(lambda: svc.demux.subscribed == set())
        assert await svc.run_alone("r1", 2) == [2]
        await svc.subscribed()
        assert svc.channels.stats()["num_subscriptions"] == 2
        svc.demux.close()
        server.close()

    asyncio.run(main())


def test_an_unreachable_channel_server_falls_back_to_serves_subscribe_call():
    async def main():
        svc = Service()
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        svc.channels.address = ChannelAddress("127.0.0.1", port, "token")
        await svc.run_alone("r0", 1)
        await svc.subscribed()
        assert len(svc.subscriptions) == 1  # Serve's call
        assert await svc.run_alone("r1", 2) == [2]
        assert svc.channels.stats()["num_muxed_requests"] == 1
        svc.demux.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "hello",
    [
        b"not json\n",
        json.dumps({"token": "wrong", "router_id": "r", "replica_id": "replica-a",
                    "subscription_id": "s"}).encode() + b"\n",
        json.dumps({"router_id": "r"}).encode() + b"\n",
    ],
)  # fmt: skip
def test_a_subscriber_without_the_token_or_a_well_formed_hello_gets_nothing(hello):
    async def main():
        svc, server = await _socket_service()
        address = await server.start()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(hello)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing sent
        writer.close()
        assert svc.channels.stats()["num_subscriptions"] == 0
        server.close()

    asyncio.run(main())


def test_a_server_that_cannot_listen_leaves_subscriptions_to_serve():
    async def main():
        svc = Service()
        server = ChannelServer(svc.channels, "192.0.2.254")  # no interface of this host
        assert await server.start() is None and await server.start() is None
        assert svc.channels.address is None
        assert await svc.run_alone("r0", 1) == [1]
        await svc.subscribed()
        assert len(svc.subscriptions) == 1  # Serve's call
        svc.demux.close()

    asyncio.run(main())
