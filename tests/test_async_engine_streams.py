"""AsyncEngine streaming on a small random-weight Llama: concurrent streams match the sync
engine, text deltas, a consumer that falls behind, and stream_interval's grouping.

Each test drives its own event loop with asyncio.run (no pytest-asyncio dependency).
"""

from __future__ import annotations

import asyncio

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
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason


def test_concurrent_generate_matches_the_sync_engine(model_dir):
    prompts = random_prompts(16)
    expected = [s.output_token_ids for s in _engine(model_dir).generate(prompts, GREEDY)]

    async def main():
        sync = _engine(model_dir)
        read = hold_steps_until_read(sync, lambda out: True)
        engine = AsyncEngine(sync)

        try:
            streams = await asyncio.wait_for(
                asyncio.gather(
                    *(_collect(engine, f"r{i}", p, GREEDY, read) for i, p in enumerate(prompts))
                ),
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
        sync = _engine(model_dir)
        # Only first tokens are held: past them the stream itself waits for more tokens.
        read = hold_steps_until_read(sync, lambda out: out.num_output_tokens == 1)
        engine = AsyncEngine(sync, stream_interval=5)

        try:
            streams = await asyncio.wait_for(
                asyncio.gather(
                    *(_collect(engine, f"r{i}", p, params, read) for i, p in enumerate(prompts))
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
        sync = _engine(model_dir)
        # Paused at 4 tokens until released, so the consumer is seen gathering however
        # late this loop runs.
        release = hold_steps_until_read(sync, lambda out: out.num_output_tokens == 4)
        engine = AsyncEngine(sync, stream_interval=64)
        try:
            stream = engine.generate("gathering", prompt, LONG)
            await anext(stream)
            # The next output waits for 64 tokens; cancel the consumer while it gathers.
            waiting = asyncio.create_task(anext(stream))
            await _until(lambda: engine.stats().num_generated_tokens == 4, "tokens gathering")
            assert not waiting.done()
            release("gathering")  # the engine steps on, and sees the abort
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
