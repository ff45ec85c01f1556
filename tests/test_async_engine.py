"""AsyncEngine on a small random-weight Llama: streaming, cancellation, backpressure, failure.

Each test drives its own event loop with asyncio.run (no pytest-asyncio dependency). Waits on
background state poll with a deadline instead of sleeping a guessed amount.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import aclosing

import pytest
from tiny_model import make_tiny_model, random_prompts

from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.errors import EngineDeadError, EngineOverloadedError
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=800, temperature=0.0, ignore_eos=True)
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 256, **overrides}))


async def _collect(engine: AsyncEngine, rid: str, prompt, params=GREEDY):
    return [out async for out in engine.generate(rid, prompt, params)]


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def _all_blocks_free(engine: AsyncEngine) -> bool:
    s = engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks


def test_concurrent_generate_matches_the_sync_engine(model_dir):
    prompts = random_prompts(16)
    expected = [s.output_token_ids for s in _engine(model_dir).generate(prompts, GREEDY)]

    async def main():
        engine = AsyncEngine(_engine(model_dir))
        try:
            streams = await asyncio.wait_for(
                asyncio.gather(*(_collect(engine, f"r{i}", p) for i, p in enumerate(prompts))),
                TIMEOUT,
            )
            await _until(lambda: _all_blocks_free(engine), "all blocks free")
            return streams
        finally:
            await engine.shutdown()

    streams = asyncio.run(main())
    for i, outs in enumerate(streams):
        assert [t for o in outs for t in o.new_token_ids] == expected[i]
        assert all(o.request_id == f"r{i}" for o in outs)
        assert [o.finished for o in outs] == [False] * 23 + [True]
        assert outs[-1].finish_reason is FinishReason.LENGTH
        assert outs[-1].num_output_tokens == 24
        assert outs[-1].num_prompt_tokens == len(prompts[i])


def test_streamed_text_concatenates_to_the_full_text(model_dir):
    sync = _engine(model_dir)
    prompt = sync.tokenizer.encode("Streaming: héllo 🙂 日本")
    full = sync.generate([prompt], GREEDY)[0].detokenizer.text

    async def main():
        engine = AsyncEngine(_engine(model_dir))
        try:
            return await _collect(engine, "text", prompt)
        finally:
            await engine.shutdown()

    outs = asyncio.run(main())
    assert "".join(o.new_text for o in outs) == full
    assert full == sync.tokenizer.decode([t for o in outs for t in o.new_token_ids])


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
            await _until(lambda: _all_blocks_free(engine), "the aborted request's blocks")
            # Aborted long before its 800 tokens.
            assert engine.stats().num_generated_tokens < LONG.max_tokens

            # Leaving the loop early (aclosing closes the generator) aborts too.
            async with aclosing(engine.generate("break-me", prompt, LONG)) as stream:
                async for _ in stream:
                    break
            await _until(lambda: _all_blocks_free(engine), "blocks after closing the stream")

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
        engine = AsyncEngine(_engine(model_dir))
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
            # A duplicate of a live request is refused; the live one is untouched.
            live = engine.generate("dup", prompt, GREEDY)
            first = await asyncio.wait_for(live.__anext__(), TIMEOUT)
            with pytest.raises(ValueError, match="already in use"):
                await engine.generate("dup", prompt, GREEDY).__anext__()
            rest = await asyncio.wait_for(_drain(live), TIMEOUT)
            # Counted in tokens: outputs that pile up while this task waits come merged.
            assert first.num_output_tokens == 1 and len(first.new_token_ids) == 1
            assert 1 + sum(len(o.new_token_ids) for o in rest) == GREEDY.max_tokens
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


def test_a_prefill_only_stream_hands_off_to_a_second_engine_through_call(model_dir):
    prompt = random_prompts(1, seed=3)[0]
    expected = _engine(model_dir).generate([prompt], GREEDY)[0].output_token_ids

    async def main():
        prefill, decode = AsyncEngine(_engine(model_dir)), AsyncEngine(_engine(model_dir))
        outs = [o async for o in prefill.generate("r", prompt, GREEDY, prefill_only=True)]
        assert len(outs) == 1 and outs[0].handoff is not None and outs[0].finish_reason is None
        handle, parts = await prefill.call(lambda e: e.export_kv("r"))
        assert await prefill.call(lambda e: e.release_handoff("r"))
        with pytest.raises(ValueError, match="holds no KV handoff"):
            await prefill.call(lambda e: e.export_kv("r"))
        stream = decode.generate_prefilled("r", prompt, GREEDY, handle, parts)
        tokens = [t async for o in stream for t in o.new_token_ids]
        assert tokens == expected
        # Stats are published just after the last output is handed out.
        await _until(lambda: _all_blocks_free(prefill) and _all_blocks_free(decode), "frees")
        await prefill.shutdown()
        await decode.shutdown()

    asyncio.run(main())


@pytest.mark.slow
def test_tp_decode_ranks_pull_the_handoff_themselves_and_a_cancel_frees_it(ray_cluster, model_dir):
    # Both engines TP 2: their ranks (actors, killed at shutdown) do every nixl transfer,
    # so no NIXL agent outlives the test in this process.
    prompts = random_prompts(3, seed=6)
    expected = [s.output_token_ids for s in _engine(model_dir).generate(prompts, GREEDY)]

    def pulled_and_staged(engine: AsyncEngine) -> list[tuple[int, int]]:
        return [(n, s) for n, _, s in engine.engine.runner.pull_stats()]

    async def handoff(prefill: AsyncEngine, rid: str, prompt: list[int]):
        [o async for o in prefill.generate(rid, prompt, GREEDY, prefill_only=True)]
        return await prefill.call(lambda e: (e.export_kv(rid), e.release_handoff(rid))[0])

    async def main():
        tp2 = {"tensor_parallel_size": 2}
        prefill = AsyncEngine(_engine(model_dir, kv_transport="nixl", **tp2))
        decode = AsyncEngine(_engine(model_dir, **tp2))
        try:
            got = []
            for i, prompt in enumerate(prompts[:2]):
                handle, parts = await handoff(prefill, f"r{i}", prompt)
                stream = decode.generate_prefilled(f"r{i}", prompt, GREEDY, handle, parts)
                got.append([t async for o in stream for t in o.new_token_ids])
            # Cancelled while its ranks may still be pulling: what they stage is dropped.
            handle, parts = await handoff(prefill, "c", prompts[2])

            async def consume():
                async for _ in decode.generate_prefilled("c", prompts[2], GREEDY, handle, parts):
                    pass

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0)  # consume() now waits on its ranks' pull
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The pull goes on after the cancel (it is not interruptible); each rank
            # then holds nothing.
            await _until(
                lambda: pulled_and_staged(decode) == [(3, 0), (3, 0)],
                "the cancelled request's pull to finish and be dropped",
            )
            return got
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    assert asyncio.run(main()) == expected[:2]


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


def test_abort_nowait_releases_a_held_handoff(model_dir):
    async def main():
        engine = AsyncEngine(_engine(model_dir))
        prompt = random_prompts(1, seed=5)[0]
        [o async for o in engine.generate("h", prompt, GREEDY, prefill_only=True)]
        await _until(lambda: engine.stats().handoffs_held == 1, "the handoff to be held")
        assert not _all_blocks_free(engine)
        engine.abort_nowait("h")
        await _until(lambda: _all_blocks_free(engine), "the held blocks to be freed")
        assert await engine.call(lambda e: len(e.handoffs)) == 0
        await engine.shutdown()

    asyncio.run(main())


def test_a_consumer_gone_before_reading_its_finished_prefill_frees_the_handoff(model_dir):
    async def main():
        engine = AsyncEngine(_engine(model_dir, handoff_timeout_s=600))
        prompt = random_prompts(1, seed=7)[0]
        stream = engine.generate("h", prompt, GREEDY, prefill_only=True)
        reader = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the reader starts: the request is queued, it waits
        # Blocking this loop: the engine finishes the prefill and holds the handoff, and
        # the output waits on the loop for a reader that is cancelled before it runs.
        deadline = time.monotonic() + TIMEOUT
        while engine.stats().handoffs_held != 1:
            assert time.monotonic() < deadline, "the handoff was never held"
            time.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await _until(lambda: _all_blocks_free(engine), "the held blocks to be freed")
        assert engine.stats().handoffs_expired == 0
        await engine.shutdown()

    asyncio.run(main())


def test_a_consumer_that_falls_behind_gets_the_backlog_merged_in_order(model_dir):
    prompt = random_prompts(1, seed=6)[0]
    expected = _engine(model_dir).generate([prompt], GREEDY)[0]

    async def main():
        engine = AsyncEngine(_engine(model_dir))
        stream = engine.generate("slow", prompt, GREEDY)
        first = await anext(stream)
        # Not reading: the engine runs ahead and finishes (its steps take milliseconds).
        n = len(expected.output_token_ids)
        await _until(lambda: engine.stats().num_generated_tokens == n, "every token")
        await asyncio.sleep(0.1)  # the last deliveries reach this loop
        outputs = [first, *[o async for o in stream]]
        tokens = [t for o in outputs for t in o.new_token_ids]
        assert tokens == expected.output_token_ids
        assert "".join(o.new_text for o in outputs) == expected.detokenizer.text
        assert len(outputs) < len(tokens)  # the backlog came as one output, not many
        assert outputs[-1].finished and outputs[-1].num_output_tokens == len(tokens)
        await engine.shutdown()

    asyncio.run(main())


def test_stream_interval_sends_the_first_token_alone_then_groups_of_at_least_n(model_dir):
    prompts = random_prompts(4, seed=9)
    params = SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)
    expected = [s.output_token_ids for s in _engine(model_dir).generate(prompts, params)]

    async def main():
        engine = AsyncEngine(_engine(model_dir), stream_interval=5)
        try:
            streams = await asyncio.wait_for(
                asyncio.gather(
                    *(_collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts))
                ),
                TIMEOUT,
            )
            await _until(lambda: _all_blocks_free(engine), "all blocks free")
            return streams
        finally:
            await engine.shutdown()

    for outs, tokens in zip(asyncio.run(main()), expected, strict=True):
        assert [t for o in outs for t in o.new_token_ids] == tokens
        assert len(outs[0].new_token_ids) == 1  # time to first token is not traded away
        assert all(len(o.new_token_ids) >= 5 for o in outs[1:-1])
        assert len(outs[-1].new_token_ids) >= 1 and outs[-1].finished
        assert [o.finished for o in outs[:-1]] == [False] * (len(outs) - 1)
        assert len(outs) <= 1 + -(-22 // 5)  # first token, then ceil(22 / 5) messages


def test_stream_interval_a_consumer_cancelled_while_tokens_gather_frees_the_blocks(model_dir):
    prompt = random_prompts(1, seed=10)[0]

    async def main():
        engine = AsyncEngine(_engine(model_dir), stream_interval=64)
        try:
            stream = engine.generate("gathering", prompt, LONG)
            await anext(stream)
            # The next output waits for 64 tokens; cancel the consumer while it gathers.
            waiting = asyncio.create_task(anext(stream))
            await _until(lambda: engine.stats().num_generated_tokens > 3, "tokens gathering")
            assert not waiting.done()
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await _until(lambda: _all_blocks_free(engine), "the cancelled request's blocks")
            assert engine.stats().num_generated_tokens < LONG.max_tokens
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_stream_interval_below_one_is_refused(model_dir):
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        AsyncEngine(_engine(model_dir), stream_interval=0)
