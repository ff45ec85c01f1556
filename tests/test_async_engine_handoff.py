"""AsyncEngine KV handoffs on a small random-weight Llama: a prefill-only stream handed to a
second engine, TP decode ranks pulling it (Ray, slow), and held handoffs freed by an abort
or a consumer that went away (one that expires while the engine idles:
test_engine_thread.py).

Each test drives its own event loop with asyncio.run (no pytest-asyncio dependency).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from async_engine_helpers import TIMEOUT, _all_blocks_free, _until
from engine_helpers import GREEDY, _engine
from tiny_model import random_prompts

from workers.engine.async_engine import AsyncEngine
from workers.errors import EngineDeadError
from workers.kv.transport import KVRef


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


def test_an_import_that_fails_in_the_engine_fails_the_engine_not_only_its_request(model_dir):
    # A failing block copy (a dead TP rank, a bug) leaves the engine half-updated: blocks
    # allocated to a request that neither waits nor runs. It is the engine's failure,
    # raised in its step, so the replica is replaced rather than left holding them.
    prompt = random_prompts(1, seed=3)[0]

    async def main():
        prefill, decode = AsyncEngine(_engine(model_dir)), AsyncEngine(_engine(model_dir))
        try:
            [o async for o in prefill.generate("r", prompt, GREEDY, prefill_only=True)]
            handle, parts = await prefill.call(lambda e: e.export_kv("r"))

            def broken(*args):
                raise RuntimeError("rank 1 died mid-copy")

            decode._engine.runner.import_blocks = broken
            with pytest.raises(EngineDeadError, match="rank 1 died mid-copy"):
                [o async for o in decode.generate_prefilled("r", prompt, GREEDY, handle, parts)]
            assert not decode.is_healthy()
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    asyncio.run(main())


@pytest.mark.slow
def test_tp_decode_ranks_pull_the_handoff_the_export_is_freed_at_import_a_cancel_frees_it(
    ray_cluster, model_dir
):
    # Both engines TP 2: their ranks (actors, killed at shutdown) do every nixl transfer,
    # so no NIXL agent outlives the test in this process.
    prompts = random_prompts(3, seed=6)
    expected = [s.output_token_ids for s in _engine(model_dir).generate(prompts, GREEDY)]

    def pulled_and_staged(engine: AsyncEngine) -> list[tuple[int, int]]:
        return [(n, s) for n, _, s in engine._engine.runner.pull_stats()]

    async def handoff(prefill: AsyncEngine, rid: str, prompt: list[int]):
        [o async for o in prefill.generate(rid, prompt, GREEDY, prefill_only=True)]
        return await prefill.call(lambda e: (e.export_kv(rid), e.release_handoff(rid))[0])

    async def main():
        tp2 = {"tensor_parallel_size": 2}
        prefill = AsyncEngine(_engine(model_dir, kv_transport="nixl", **tp2))
        # A pull budget of one byte: one pull at a time (each is admitted alone).
        decode = AsyncEngine(_engine(model_dir, **tp2), max_pulled_kv_bytes=1)
        try:
            got = []
            for i, prompt in enumerate(prompts[:2]):
                handle, parts = await handoff(prefill, f"r{i}", prompt)
                nbytes = sum(p.nbytes for p in parts)
                assert prefill.live_kv_exports() == (2, nbytes)  # one slice per rank
                stream = decode.generate_prefilled(f"r{i}", prompt, GREEDY, handle, parts)
                del parts  # from here on only the decode side holds the export
                first = await anext(stream)  # comes after the import
                # The prefill ranks free their slices now, not when the request ends.
                await _until(lambda: prefill.live_kv_exports() == (0, 0), "the free")
                got.append(first.new_token_ids + [t async for o in stream for t in o.new_token_ids])
            # Two at once: the second pull waits for the first one's import.
            exports = [await handoff(prefill, f"s{i}", p) for i, p in enumerate(prompts[:2])]

            async def decode_one(i: int) -> list[int]:
                stream = decode.generate_prefilled(f"s{i}", prompts[i], GREEDY, *exports[i])
                return [t async for o in stream for t in o.new_token_ids]

            both = asyncio.gather(decode_one(0), decode_one(1))
            await _until(lambda: decode.pull_budget.num_waiting == 1, "the second pull to wait")
            assert await both == got
            assert decode.pull_budget.used == 0
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
                lambda: pulled_and_staged(decode) == [(5, 0), (5, 0)],
                "the cancelled request's pull to finish and be dropped",
            )
            assert decode.pull_budget.used == 0
            return got
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    assert asyncio.run(main()) == expected[:2]


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


def test_a_refused_duplicate_whose_consumer_left_does_not_free_the_ids_handoff(model_dir):
    async def main():
        engine = AsyncEngine(_engine(model_dir, handoff_timeout_s=600))
        prompt = random_prompts(1, seed=8)[0]
        [o async for o in engine.generate("x", prompt, GREEDY, prefill_only=True)]
        # A second request under the id the handoff holds is refused in the engine; its
        # consumer leaves before the refusal arrives.
        reader = asyncio.ensure_future(anext(engine.generate("x", prompt[:3], GREEDY)))
        await asyncio.sleep(0)  # the add is queued
        reader.cancel()
        with pytest.raises((asyncio.CancelledError, ValueError)):
            await reader
        # Commands run in order: once this call answers, the abort has run.
        assert await engine.call(lambda e: len(e.handoffs)) == 1
        handle, _ = await engine.call(lambda e: e.export_kv("x"))
        assert handle.request_id == "x"
        assert await engine.call(lambda e: e.release_handoff("x"))
        await _until(lambda: _all_blocks_free(engine), "the handoff's blocks to be freed")
        await engine.shutdown()

    asyncio.run(main())


@pytest.mark.slow
def test_a_tp_rank_that_dies_during_a_pull_makes_the_engine_unhealthy_at_once(
    ray_cluster, model_dir
):
    # Pulls run off the engine thread: an idle engine would never step into the dead
    # rank, so without this its replica would keep passing health checks and drawing
    # requests that all fail.
    ray = ray_cluster

    async def main():
        engine = AsyncEngine(_engine(model_dir, tensor_parallel_size=2))
        try:
            cfg, block = engine._engine.model_config, engine._engine.config.block_size
            shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 1, block, cfg.head_dim)
            data = ray.put(torch.zeros(shape))
            part = KVRef(((0, shape[2], data),), shape, torch.float32, 0, 1)
            assert engine.is_healthy()
            ray.kill(engine._engine.runner.workers[1])
            with pytest.raises(EngineDeadError, match="TP rank 1 of 2 failed"):
                await asyncio.to_thread(engine._engine.prefetch_kv, [part])
            assert not engine.is_healthy()
        finally:
            await engine.shutdown()

    asyncio.run(main())
