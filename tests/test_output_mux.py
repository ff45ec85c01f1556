"""Outputs multiplexed per router (serve_app/streaming/output_channels.py): both halves wired in one
event loop, with each "remote call" a task of its own, cancelled as Serve cancels one
(output_mux_helpers.py)."""

from __future__ import annotations

import asyncio

import pytest
from output_mux_helpers import (
    REQUEST,
    Call,
    Service,
    _collect,
    _eventually,
    _muxed_service,
    _out,
    _tokens,
)

from serve_app.errors import SubscriptionLost
from serve_app.protocol import StreamStart, Subscription
from serve_app.streaming.output_channel import OutputChannel
from serve_app.streaming.output_channels import OutputChannels
from workers.engine.outputs import RequestOutput


def test_the_first_request_streams_on_its_call_and_later_ones_share_a_subscription():
    async def main():
        svc = Service()
        assert await svc.run_alone("r0", 1) == [1]
        await svc.subscribed()
        assert svc.channels.stats()["num_muxed_requests"] == 0

        rids = [f"r{i}" for i in range(1, 5)]
        received: dict[str, list[RequestOutput]] = {r: [] for r in rids}

        async def collect(rid: str) -> None:
            async for out in svc.request(rid)[1]:
                received[rid].append(out)

        tasks = [asyncio.ensure_future(collect(r)) for r in rids]
        await svc.engine.wait_for(*rids)
        for token in range(1, 4):
            svc.engine.step(token)
            # Every consumer has this step's token before the next step is taken.
            await _eventually(lambda t=token: all(_tokens(received[r])[-1:] == [t] for r in rids))
        svc.engine.step(4, finish=True)
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        for outs in received.values():
            assert _tokens(outs) == [1, 2, 3, 4] and outs[-1].finished
        stats = svc.channels.stats()
        assert stats["num_muxed_requests"] == 4
        assert stats["num_batches"] == 4 and stats["num_outputs"] == 16  # a batch per step
        svc.demux.close()

    asyncio.run(main())


def test_a_subscription_is_no_requests_child_call():
    """Opened while one request is served, the subscribe call must not run in that
    request's context: Serve makes such a call a child of the request and cancels it,
    with every stream it carries, when that request's client leaves."""

    async def main():
        svc = Service()

        async def serve_r0() -> list[int]:
            REQUEST.set("r0")
            return await svc.run_alone("r0", 1)

        assert await asyncio.ensure_future(serve_r0()) == [1]
        await svc.subscribed()
        assert svc.subscribed_in == [None]
        svc.demux.close()

    asyncio.run(main())


def test_a_channel_merges_what_piled_up_per_request_in_order():
    async def main():
        channel = OutputChannel()
        channel.put(_out("a", [1]))
        channel.put(_out("b", [7]))
        channel.put(_out("a", [2]))
        channel.put(_out("a", [3], finished=True))
        batch = await channel.next_batch(idle_s=1.0)
        assert [(o.request_id, o.new_token_ids, o.finished) for o in batch] == [
            ("a", [1, 2, 3], True),
            ("b", [7], False),
        ]

    asyncio.run(main())


def test_a_subscription_ends_when_idle_but_not_while_a_muxed_request_is_live():
    async def main():
        svc = Service(idle_s=0.05)
        await svc.run_alone("r0", 1)
        await svc.subscribed()
        _, live = svc.request("r1")
        task = asyncio.ensure_future(_collect(live))
        await svc.engine.wait_for("r1")
        await asyncio.sleep(0.3)  # no output for six idle periods: the request holds it
        assert svc.channels.stats()["open_subscriptions"] == 1
        svc.engine.step(5, finish=True)
        assert _tokens(await task) == [5]
        await _eventually(lambda: svc.channels.stats()["open_subscriptions"] == 0)
        # The next request streams on its call again, and subscribes anew.
        assert await svc.run_alone("r2", 6) == [6]
        await svc.subscribed()
        assert svc.channels.stats()["num_subscriptions"] == 2

    asyncio.run(main())


def test_a_muxed_requests_error_reaches_its_consumer():
    async def main():
        svc = await _muxed_service()
        _, outputs = svc.request("bad")
        await svc.engine.wait_for("bad")
        svc.engine.queues["bad"].put_nowait(ValueError("temperature must be >= 0"))
        with pytest.raises(ValueError, match="temperature"):
            await _collect(outputs)
        await _eventually(lambda: svc.engine.closed >= {"bad"})
        assert svc.channels.stats()["num_muxed_requests"] == 1

    asyncio.run(main())


def test_a_consumer_that_leaves_cancels_its_call_and_the_engine_stream_closes():
    async def main():
        svc = await _muxed_service()
        call, outputs = await svc.decoding("left")
        call.cancel()  # what the router does when its client leaves
        await outputs.aclose()
        await _eventually(lambda: "left" in svc.engine.closed)
        assert svc.demux.num_requests == 0
        # The subscription carries on for the other requests.
        assert await svc.run_alone("next", 2) == [2]
        assert svc.channels.stats()["num_muxed_requests"] == 2

    asyncio.run(main())


def test_a_lost_subscription_fails_the_requests_it_carried_on_both_sides():
    async def main():
        svc = await _muxed_service()
        call, outputs = await svc.decoding("carried")
        svc.subscriptions[-1].cancel()  # the subscription call fails
        with pytest.raises(SubscriptionLost):
            await anext(outputs)
        call.cancel()
        await _eventually(lambda: "carried" in svc.engine.closed)
        assert svc.channels.stats()["open_subscriptions"] == 0

    asyncio.run(main())


def test_a_muxed_start_naming_an_ended_subscription_fails_instead_of_waiting_for_ever():
    # The request registers; its subscription fails before its StreamStart arrives (its
    # outputs went to that subscription's channel, now gone); another request opens a new
    # subscription to the same replica; then the StreamStart arrives.
    async def main():
        svc = await _muxed_service()
        (ended,) = svc.subs
        started = asyncio.get_running_loop().create_future()

        async def late_call():
            await started
            yield StreamStart("replica-a", True, ended.subscription_id)

        pending = asyncio.ensure_future(_collect(svc.demux.outputs("late", Call(late_call()))))
        svc.subscriptions[-1].cancel()
        await _eventually(lambda: svc.demux.subscribed == set())
        assert await svc.run_alone("next", 2) == [2]  # on its call: it subscribes anew
        await svc.subscribed()
        assert svc.subs[-1].subscription_id != ended.subscription_id
        started.set_result(None)
        with pytest.raises(SubscriptionLost):
            await asyncio.wait_for(pending, 5)
        assert svc.demux.num_requests == 0

    asyncio.run(main())


def test_the_same_subscribe_call_again_just_ends():
    async def main():
        channels = OutputChannels("replica-a")
        sub = Subscription("router-1", "replica-a", "sub-1")
        first = channels.subscribe(sub)
        assert await anext(first) == "replica-a"
        pending = asyncio.ensure_future(anext(first))
        await asyncio.sleep(0)
        second = channels.subscribe(sub)
        assert [item async for item in second] == ["replica-a"]
        assert channels.stats()["open_subscriptions"] == 1
        assert not pending.done()
        pending.cancel()

    asyncio.run(main())


def test_a_routers_new_subscription_replaces_one_that_ended_only_on_its_side():
    # The router gave up its subscription, but the replica never saw that call end: the
    # router's next subscription takes the channel over at once, rather than each of its
    # muxed streams here failing until the old channel idles out.
    async def main():
        svc = Service(idle_s=60.0)
        old = Call(svc.channels.subscribe(Subscription(svc.demux.router_id, "replica-a", "old")))
        assert await anext(old) == "replica-a"
        assert svc.channels.stats()["open_subscriptions"] == 1
        with pytest.raises(SubscriptionLost):  # muxed into the channel the router gave up
            await svc.run_alone("r0", 1)
        await _eventually(lambda: svc.subs and old.done())  # and a new subscription took over
        async for _ in old:  # the old call ended, with no error, r0's output in it or not
            pass
        assert svc.channels.stats()["open_subscriptions"] == 1
        assert svc.channels.stats()["num_subscriptions"] == 2
        assert await svc.run_alone("r1", 2) == [2]
        assert svc.channels.stats()["num_muxed_requests"] == 2  # r0 on the old, r1 the new

    asyncio.run(main())


def test_a_subscription_meant_for_another_replica_opens_no_channel():
    async def main():
        channels = OutputChannels("replica-b")
        misrouted = channels.subscribe(Subscription("router-1", "replica-a"))
        assert await anext(misrouted) == "replica-b"
        with pytest.raises(StopAsyncIteration):  # at once, not when a channel idles out
            await asyncio.wait_for(anext(misrouted), 1.0)
        assert channels.stats()["open_subscriptions"] == 0

    asyncio.run(main())


def test_a_subscription_that_lands_on_another_replica_is_cancelled():
    async def main():
        elsewhere = OutputChannels("replica-b")
        svc = Service(elsewhere=elsewhere)
        assert await svc.run_alone("r0", 1) == [1]
        await _eventually(lambda: svc.subscriptions and svc.subscriptions[0].done())
        assert len(svc.subscriptions) == 1
        assert elsewhere.stats()["open_subscriptions"] == 0
        assert svc.demux.subscribed == set()

    asyncio.run(main())


def test_stream_start_says_where_and_how():
    async def main():
        channels = OutputChannels("replica-a")

        async def one():
            yield _out("x", [3], finished=True)

        items = [item async for item in channels.stream(None, one())]
        assert items[0] == StreamStart("replica-a", muxed=False, subscription_id=None)
        assert _tokens(items[1:]) == [3]

    asyncio.run(main())
