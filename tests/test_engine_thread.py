"""AsyncEngine's engine thread (workers/engine/engine_thread.py) on a small random-weight
Llama: it sleeps while idle, yet wakes for requests and for a held handoff's deadline, and
a step that fails fails every request and is never stepped again.

Each test drives its own event loop with asyncio.run (no pytest-asyncio dependency).
"""

from __future__ import annotations

import asyncio

import pytest
from async_engine_helpers import LONG, TIMEOUT, _all_blocks_free, _collect, _until
from engine_helpers import GREEDY, _engine
from tiny_model import random_prompts

from workers.engine.async_engine import AsyncEngine
from workers.errors import EngineDeadError


def test_idle_engine_thread_sleeps_and_wakes_on_a_request(model_dir):
    prompt = random_prompts(1)[0]
    llm = _engine(model_dir)
    real_has_unfinished, polls = llm.has_unfinished, []

    def counting_has_unfinished():
        polls.append(None)
        return real_has_unfinished()

    llm.has_unfinished = counting_has_unfinished

    async def main():
        engine = AsyncEngine(llm)
        try:
            for rid in ("first", "second"):
                assert (await asyncio.wait_for(_collect(engine, rid, prompt), TIMEOUT))[-1].finished
                await _until(lambda: _all_blocks_free(engine), "the request to finish")
                before = len(polls)
                # An observation window, not a wait for state: a spinning loop would poll
                # the engine thousands of times in it.
                await asyncio.sleep(0.1)
                assert len(polls) - before <= 2
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_held_handoff_expires_while_the_engine_is_idle(model_dir):
    async def main():
        engine = AsyncEngine(_engine(model_dir, handoff_timeout_s=0.2))
        prompt = random_prompts(1, seed=4)[0]
        outs = [o async for o in engine.generate("h", prompt, GREEDY, prefill_only=True)]
        assert outs[-1].handoff is not None
        # Nothing else happens: the engine thread must wake for the deadline on its own.
        await _until(lambda: engine.stats().handoffs_expired == 1, "the handoff to expire")
        await _until(lambda: _all_blocks_free(engine), "the expired blocks to be freed")
        await engine.shutdown()

    asyncio.run(main())


def test_step_failure_fails_every_request_and_marks_the_engine_dead(model_dir):
    prompts = random_prompts(4)
    llm = _engine(model_dir)
    real_step, calls = llm.step, []

    def failing_step():
        calls.append(None)
        if len(calls) == 5:
            raise RuntimeError("TP rank 1 died")
        return real_step()

    llm.step = failing_step

    async def main():
        engine = AsyncEngine(llm)
        try:
            results = await asyncio.wait_for(
                asyncio.gather(
                    *(_collect(engine, f"r{i}", p, LONG) for i, p in enumerate(prompts)),
                    return_exceptions=True,
                ),
                TIMEOUT,
            )
            for err in results:
                assert isinstance(err, EngineDeadError) and isinstance(err, RuntimeError)
                assert "TP rank 1 died" in str(err)
                assert isinstance(err.__cause__, RuntimeError)
            assert not engine.is_healthy()
            with pytest.raises(EngineDeadError, match="TP rank 1 died"):
                await engine.generate("late", prompts[0], GREEDY).__anext__()
            assert not await engine.abort("r0")
            assert engine.stats().num_total_blocks == 256  # still answers
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert len(calls) == 5  # the engine was never stepped again
