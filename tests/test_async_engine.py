"""AsyncEngine on a small random-weight Llama: cancellation, aborts, refused requests,
backpressure and shutdown.

Streaming is in test_async_engine_streams.py, KV handoffs in test_async_engine_handoff.py,
the engine thread's sleeping and failing in test_engine_thread.py.
Each test drives its own event loop with asyncio.run (no pytest-asyncio dependency).
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing

import pytest
from async_engine_helpers import (
    LONG,
    TIMEOUT,
    _all_blocks_free,
    _collect,
    _until,
    hold_steps_until_read,
)
from engine_helpers import GREEDY, _engine
from tiny_model import random_prompts

from workers.engine.async_engine import AsyncEngine
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason
from workers.errors import EngineDeadError, EngineOverloadedError


def test_cancelling_a_consumer_aborts_its_request_and_frees_blocks(model_dir):
    prompt = random_prompts(1)[0]

    async def main():
        engine = AsyncEngine(_engine(model_dir))
        try:
            got_two = asyncio.Event()
            seen = []

            async def consume():
                async for out in engine.generate("cancel-me", prompt, LONG):
                    seen.append(out)
                    if len(seen) == 2:
                        got_two.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(got_two.wait(), TIMEOUT)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Stats read on the engine thread, after the abort the cancel queued: the
            # published ones may predate the request.
            s = await engine.call(lambda e: e.stats())
            assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_total_blocks)
            # Aborted long before its 800 tokens.
            assert s.num_generated_tokens < LONG.max_tokens

            # Leaving the loop early (aclosing closes the generator) aborts too.
            before = s.num_generated_tokens
            async with aclosing(engine.generate("break-me", prompt, LONG)) as stream:
                async for _ in stream:
                    break
            s = await engine.call(lambda e: e.stats())
            assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_total_blocks)
            assert s.num_generated_tokens - before < LONG.max_tokens

            # The engine keeps serving, and the ids are free again.
            outs = await asyncio.wait_for(_collect(engine, "cancel-me", prompt), TIMEOUT)
            assert outs[-1].finished and outs[-1].num_output_tokens == GREEDY.max_tokens
            assert engine.is_healthy()
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_abort_by_id_ends_the_stream_with_an_abort_output(model_dir):
    prompt = random_prompts(1)[0]

    async def main():
        engine = AsyncEngine(_engine(model_dir))
        try:
            stream = engine.generate("a", prompt, LONG)
            first = await asyncio.wait_for(stream.__anext__(), TIMEOUT)
            assert await engine.abort("a")
            assert not await engine.abort("a")
            assert not await engine.abort("never-added")
            rest = await asyncio.wait_for(_drain(stream), TIMEOUT)
            last = rest[-1]
            assert last.finished and last.finish_reason is FinishReason.ABORT
            assert last.num_prompt_tokens == len(prompt)
            # Tokens made before the abort still arrive (possibly merged into the last
            # output, if the consumer was behind), and the count says how many.
            received = [t for out in (first, *rest) for t in out.new_token_ids]
            assert len(received) == last.num_output_tokens >= 1
            await _until(lambda: _all_blocks_free(engine), "blocks after abort")
        finally:
            await engine.shutdown()

    asyncio.run(main())


async def _drain(stream):
    return [out async for out in stream]


def test_invalid_request_raises_before_any_output_and_the_engine_keeps_serving(model_dir):
    prompt = random_prompts(1)[0]

    async def main():
        sync = _engine(model_dir)
        read = hold_steps_until_read(sync, lambda out: out.num_output_tokens == 1)
        engine = AsyncEngine(sync)
        try:
            bad = [
                ("bad-token", [5, 10_000], GREEDY, "prompt token ids"),
                ("empty", [], GREEDY, "at least one token"),
                ("too-long", prompt, SamplingParams(max_tokens=1020), "context length"),
                ("bad-stop", prompt, SamplingParams(stop_token_ids=[999]), "stop_token_ids"),
            ]
            for rid, p, params, message in bad:
                seen = []
                with pytest.raises(ValueError, match=message):
                    async for out in engine.generate(rid, p, params):
                        seen.append(out)
                assert seen == []
            # A duplicate of a live request is refused; the live one is untouched. (LONG:
            # the live one must outlast this task's turn however late the loop runs it.)
            live = engine.generate("dup", prompt, LONG)
            first = await asyncio.wait_for(live.__anext__(), TIMEOUT)
            read("dup")
            with pytest.raises(ValueError, match="already in use"):
                await engine.generate("dup", prompt, GREEDY).__anext__()
            rest = await asyncio.wait_for(_drain(live), TIMEOUT)
            # Counted in tokens: outputs that pile up while this task waits come merged.
            assert first.num_output_tokens == 1 and len(first.new_token_ids) == 1
            assert 1 + sum(len(o.new_token_ids) for o in rest) == LONG.max_tokens
            assert rest[-1].finished
            assert engine.is_healthy()
            await _until(lambda: _all_blocks_free(engine), "all blocks free")
        finally:
            await engine.shutdown()

    asyncio.run(main())


def _gate_steps(llm: LLMEngine) -> tuple[threading.Event, threading.Event]:
    """Makes the engine thread stop inside its next step until `release` is set."""
    entered, release = threading.Event(), threading.Event()
    real_step = llm.step

    def gated_step():
        entered.set()
        if not release.wait(TIMEOUT):
            raise AssertionError("the test never released the gated step")
        return real_step()

    llm.step = gated_step
    return entered, release


def test_overload_raises_engine_overloaded_error(model_dir):
    prompts = random_prompts(4)
    llm = _engine(model_dir)

    async def main():
        engine = AsyncEngine(llm, max_pending_requests=3)
        try:
            entered, release = _gate_steps(llm)
            # While the engine thread is held inside a step, nothing leaves the waiting queue.
            tasks = [asyncio.create_task(_collect(engine, "r0", prompts[0]))]
            await asyncio.wait_for(asyncio.to_thread(entered.wait), TIMEOUT)
            tasks += [asyncio.create_task(_collect(engine, f"r{i}", prompts[i])) for i in (1, 2)]
            # One yield runs both new tasks up to their first await, by which point
            # generate() has queued their adds (it does so before awaiting anything).
            await asyncio.sleep(0)
            with pytest.raises(EngineOverloadedError, match="3 requests"):
                await engine.generate("r3", prompts[3], GREEDY).__anext__()
            release.set()
            results = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
            assert all(r[-1].finished for r in results)
            # Once the queue drains, requests are accepted again.
            await _until(lambda: engine.stats().num_waiting == 0, "the queue to drain")
            assert (await _collect(engine, "r3", prompts[3]))[-1].finished
        finally:
            await engine.shutdown()

    assert issubclass(EngineOverloadedError, RuntimeError)
    asyncio.run(main())


def test_shutdown_aborts_in_flight_requests_and_joins_the_thread(model_dir):
    prompt = random_prompts(1)[0]
    llm = _engine(model_dir)
    shut_down = []
    llm.shutdown = lambda: shut_down.append(True)

    async def main():
        engine = AsyncEngine(llm)
        stream = engine.generate("s", prompt, LONG)
        await asyncio.wait_for(stream.__anext__(), TIMEOUT)
        await asyncio.wait_for(engine.shutdown(), TIMEOUT)
        rest = await asyncio.wait_for(_drain(stream), TIMEOUT)
        assert rest[-1].finish_reason is FinishReason.ABORT
        assert not engine._thread.is_alive()
        assert not engine.is_healthy()
        assert _all_blocks_free(engine)
        with pytest.raises(EngineDeadError, match="shut down"):
            await engine.generate("t", prompt, GREEDY).__anext__()
        await engine.shutdown()  # idempotent

    asyncio.run(main())
    assert shut_down == [True]
