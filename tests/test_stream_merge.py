"""merge_streams: several async streams interleaved as their items come."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.streaming.stream_merge import merge_streams


async def _ticks(name: str, n: int, delay: float, log: list[str]):
    try:
        for i in range(n):
            await asyncio.sleep(delay)
            yield f"{name}{i}"
        log.append(f"{name} done")
    except asyncio.CancelledError:
        log.append(f"{name} cancelled")
        raise


def test_items_come_as_they_arrive_tagged_with_their_stream():
    async def run():
        log: list[str] = []
        streams = [_ticks("a", 3, 0.2, log), _ticks("b", 2, 0.01, log)]
        return [x async for x in merge_streams(streams)], log

    got, log = asyncio.run(run())
    assert sorted(got) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert got[0] == (1, "b0")  # the faster stream's first item is not held back
    assert [i for i, x in got if i == 0] == [0, 0, 0] and sorted(log) == ["a done", "b done"]


def test_one_stream_failing_ends_the_merge_and_cancels_the_rest():
    async def failing():
        yield "x"
        await asyncio.sleep(0.02)
        raise ValueError("boom")

    async def run():
        log: list[str] = []
        got = []
        with pytest.raises(ValueError, match="boom"):
            async for item in merge_streams([failing(), _ticks("slow", 100, 0.01, log)]):
                got.append(item)
        await asyncio.sleep(0.05)  # the cancelled stream runs its handler
        return got, log

    got, log = asyncio.run(run())
    assert (0, "x") in got and log == ["slow cancelled"]


def test_a_consumer_that_stops_early_cancels_every_stream():
    async def run():
        log: list[str] = []
        merged = merge_streams([_ticks("a", 100, 0.01, log), _ticks("b", 100, 0.01, log)])
        await anext(merged)
        await merged.aclose()
        await asyncio.sleep(0.05)
        return log

    assert sorted(asyncio.run(run())) == ["a cancelled", "b cancelled"]


def test_a_stream_that_ends_cancelled_by_itself_ends_the_merge_too():
    async def cancelled_by_its_source():
        yield "x"
        raise asyncio.CancelledError  # as Serve ends a stream whose call was cancelled

    async def run():
        log: list[str] = []
        got = []
        merged = merge_streams([cancelled_by_its_source(), _ticks("slow", 100, 0.01, log)])
        with pytest.raises(asyncio.CancelledError):
            async for item in merged:
                got.append(item)
        await asyncio.sleep(0.05)
        return got, log

    got, log = asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert (0, "x") in got and log == ["slow cancelled"]
