"""serve_app/handoff/decode_handoff.py on a real in-process engine (tiny model) and a prefill
pool that answers, or fails, as Serve's handle would (the whole path runs live in
test_service*.py)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest
from async_engine_helpers import _collect
from engine_helpers import GREEDY, _engine
from ray.exceptions import RayActorError

from serve_app.engine_server import EngineServer
from serve_app.handoff.decode_handoff import DecodeHandoff
from serve_app.protocol import EngineRequest, PrefillResult
from workers.engine.async_engine import AsyncEngine
from workers.engine.block_hash import hash_full_blocks, root_hash
from workers.engine.handoff.handle import StalePrefixError
from workers.engine.outputs import RequestOutput
from workers.engine.sequence import FinishReason
from workers.kv.transport import KVTransferError

PROMPT = list(range(5, 45))  # 2 full blocks of 16 and a partial one
BLOCK_BYTES = 4096  # what each block of an export counts for in the handoff budget


class _PrefillPool:
    def __init__(self, answer) -> None:
        self.calls = 0
        self.prefill = SimpleNamespace(remote=self._call)
        self._answer = answer

    def _call(self, request, have, tp, transport):
        self.calls += 1
        response = asyncio.get_running_loop().create_future()
        self._answer(response)
        return response


class _AlwaysStale(AsyncEngine):
    """Evicts the reported prefix before every import, as a decode replica short of KV
    blocks would."""

    def generate_prefilled(self, request_id, prompt, params, handle, kv_parts, *args, **kw):
        async def stale():
            raise StalePrefixError("the prefix went", 0)
            yield

        return stale()


class _Watch:
    """The prefill pool's running replicas as PoolWatch reports them, set by the test."""

    def __init__(self) -> None:
        self.running = True

    def has_running(self) -> bool:
        return self.running

    async def refreshed(self, timeout_s: float) -> None:
        """The test's setting is the controller's latest answer."""


def _handoff(
    engine: AsyncEngine, pool, recomputed: list | None = None, watch: _Watch | None = None, **kw
) -> DecodeHandoff:
    metrics = SimpleNamespace(
        recompute=(recomputed if recomputed is not None else []).append,
        handoff=lambda num_bytes, seconds: None,
        local_prefill=lambda degraded=False: None,
        degraded=lambda down: None,
    )
    watch = watch or _Watch()
    handoff = DecodeHandoff(
        engine, pool, watch, metrics, block_size=16, block_bytes=BLOCK_BYTES, **kw
    )
    handoff.budget.capacity = 3 * BLOCK_BYTES  # one request's worth of handoff in flight
    return handoff


def _request(engine: AsyncEngine, prompt: list[int]) -> EngineRequest:
    kv = engine._engine.kv  # hashed as the router hashes a prompt
    hashes = hash_full_blocks(prompt, kv.block_size, root_hash(kv.model_id, None))
    return EngineRequest("r", tuple(prompt), GREEDY, None, block_hashes=tuple(hashes))


async def _tokens(outputs) -> list[int]:
    return [t async for o in outputs for t in o.new_token_ids]


async def _until(condition, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


def test_a_prompt_whose_logprobs_are_asked_counts_as_uncached_whole(model_dir):
    engine = AsyncEngine(_engine(model_dir))
    handoff = _handoff(engine, None, local_prefill_tokens=64)

    async def main():
        request = _request(engine, PROMPT)
        await _tokens(handoff.generate(request))  # caches PROMPT's 2 full blocks
        await _tokens(handoff.generate(replace(request, request_id="again")))
        assert handoff.stats.local_prefill_tokens == 40 + 8
        asked = replace(GREEDY, prompt_logprobs=0)
        await _tokens(handoff.generate(replace(request, request_id="asked", params=asked)))
        assert handoff.stats.local_prefill_tokens == 40 + 8 + 40
        await engine.shutdown()

    asyncio.run(main())


def test_a_failed_prefill_call_is_recomputed_on_decode_with_the_same_output(model_dir):
    recomputed = []

    async def main():
        engine = AsyncEngine(_engine(model_dir))
        try:
            want = [t for o in await _collect(engine, "alone", PROMPT) for t in o.new_token_ids]
            dead = _PrefillPool(lambda r: r.set_exception(RayActorError()))
            handoff = _handoff(engine, dead, recomputed, max_pending_prefills=1)
            got = await _tokens(handoff.generate(_request(engine, PROMPT)))
            assert handoff.selective.num_pending_prefills == 0 and handoff.budget.used == 0
            return want, got, handoff.stats
        finally:
            await engine.shutdown()

    want, got, stats = asyncio.run(main())
    assert got == want
    # The prompt's two full blocks were cached by the run alone: only the rest is redone.
    assert stats.num_recomputed_tokens == recomputed[0] == len(PROMPT) - 2 * 16
    assert "RayActorError" in stats.last_failure


def test_while_the_prefill_pool_has_no_running_replica_decode_prefills_itself(model_dir):
    async def main():
        alone = AsyncEngine(_engine(model_dir))
        prefill, decode = AsyncEngine(_engine(model_dir)), AsyncEngine(_engine(model_dir))
        try:
            want = [t for o in await _collect(alone, "alone", PROMPT) for t in o.new_token_ids]
            pool, watch, changes = _LivePrefillPool(prefill), _Watch(), []
            handoff = _handoff(decode, pool, watch=watch)
            handoff.metrics.degraded = changes.append
            watch.running = False
            assert await _tokens(handoff.generate(_request(decode, PROMPT))) == want
            stats = handoff.stats
            assert not pool.transports and stats.prefill_pool_down and changes == [True]
            assert stats.num_degraded_prefills == stats.num_local_prefills == 1
            assert stats.local_prefill_tokens == len(PROMPT) and handoff.budget.used == 0
            # Running again: the next prompt is handed off, degraded mode is over.
            watch.running = True
            request = replace(_request(decode, PROMPT[:20]), request_id="later")
            await _tokens(handoff.generate(request))
            assert len(pool.transports) == 1 and stats.num_handoffs == 1
            assert not stats.prefill_pool_down
            assert changes == [True, False] and stats.num_degraded_prefills == 1
        finally:
            for engine in (alone, prefill, decode):
                await engine.shutdown()

    asyncio.run(main())


def test_a_prefill_call_waiting_when_the_pool_goes_down_is_prefilled_here(model_dir):
    # Serve's handle holds a call to a pool with no replica until one starts.
    async def main():
        engine = AsyncEngine(_engine(model_dir))
        try:
            want = [t for o in await _collect(engine, "alone", PROMPT) for t in o.new_token_ids]
            pool, watch = _PrefillPool(lambda response: None), _Watch()  # never answers
            handoff = _handoff(engine, pool, watch=watch)
            decoding = asyncio.ensure_future(_tokens(handoff.generate(_request(engine, PROMPT))))
            await _until(lambda: pool.calls == 1)
            watch.running = False
            assert await decoding == want
            stats = handoff.stats
            assert stats.num_degraded_prefills == 1 and stats.num_recomputed_tokens == 0
            assert handoff.selective.num_pending_prefills == 0 and handoff.budget.used == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


class _StoppingPrefill(AsyncEngine):
    """Ends each prefill with an ABORT and no handoff, as a prefill replica that is
    stopping does to the prefills it has in flight."""

    async def generate(self, request_id, *args, **kwargs):
        yield RequestOutput(request_id, [], "", finished=True, finish_reason=FinishReason.ABORT)


def test_a_prefill_its_stopping_replica_aborted_is_recomputed_on_decode(model_dir):
    """Not handed on as the request's end (an ABORT with no tokens): the prefill replica
    failed it, and decode computes the prompt itself."""
    recomputed = []

    async def main():
        prefill = _StoppingPrefill(_engine(model_dir))
        decode, cold = AsyncEngine(_engine(model_dir)), AsyncEngine(_engine(model_dir))
        try:
            want = [t for o in await _collect(cold, "alone", PROMPT) for t in o.new_token_ids]
            handoff = _handoff(decode, _LivePrefillPool(prefill), recomputed)
            got = await _tokens(handoff.generate(_request(decode, PROMPT)))
            return want, got, handoff.stats
        finally:
            for engine in (prefill, decode, cold):
                await engine.shutdown()

    want, got, stats = asyncio.run(main())
    assert got == want and len(got) == GREEDY.max_tokens
    assert stats.num_recomputed_tokens == recomputed[0] == len(PROMPT)
    assert "it is stopping" in stats.last_failure


def test_a_prefix_that_goes_stale_on_every_try_is_recomputed_not_failed(model_dir):
    recomputed = []

    async def main():
        engine = _AlwaysStale(_engine(model_dir))
        try:
            want = [t for o in await _collect(engine, "alone", PROMPT) for t in o.new_token_ids]
            first = RequestOutput("r", [want[0]], "", num_prompt_tokens=len(PROMPT))
            handle = SimpleNamespace()  # never read: the import is refused first
            answer = PrefillResult(first, handle, [], prefill_s=0.0)
            pool = _PrefillPool(lambda r: r.set_result(answer))
            handoff = _handoff(engine, pool, recomputed)
            got = await _tokens(handoff.generate(_request(engine, PROMPT)))
            assert handoff.budget.used == 0
            return want, got, handoff.stats, pool.calls
        finally:
            await engine.shutdown()

    want, got, stats, calls = asyncio.run(main())
    assert got == want and calls == 4  # the first try and three retries
    assert stats.num_stale_retries == 4 and "StalePrefixError" in stats.last_failure
    assert recomputed == [len(PROMPT)]  # the last stale answer said 0 blocks held


def test_decode_asks_for_a_prefill_only_while_its_handoffs_in_flight_leave_room(model_dir):
    async def main():
        engine = AsyncEngine(_engine(model_dir))
        try:
            pool = _PrefillPool(lambda r: r.set_exception(RayActorError()))
            handoff = _handoff(engine, pool)
            budget = handoff.budget
            await budget.acquire(budget.capacity)  # handoffs in flight hold it all
            decoding = asyncio.ensure_future(_tokens(handoff.generate(_request(engine, PROMPT))))
            await _until(lambda: budget.num_waiting == 1)
            assert pool.calls == 0
            budget.release(budget.capacity)
            await decoding
            assert pool.calls == 1 and budget.used == 0
            # Cancelled while it waits for room, a request takes nothing.
            await budget.acquire(budget.capacity)
            waiting = asyncio.ensure_future(_tokens(handoff.generate(_request(engine, PROMPT))))
            await _until(lambda: budget.num_waiting == 1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            budget.release(budget.capacity)
            assert budget.used == 0 and pool.calls == 1
        finally:
            await engine.shutdown()

    asyncio.run(main())


class _PrefillReplica(EngineServer):
    def __del__(self) -> None:  # Serve awaits the real one on shutdown; nothing to undo here
        pass


class _LivePrefillPool:
    """The prefill role's own code (EngineServer.prefill) on an in-process engine, called
    as the decode replica calls the pool."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.replica = _PrefillReplica.__new__(_PrefillReplica)
        self.replica.role, self.replica.engine = "prefill", engine
        # What the replica records of each prefill's time (the metrics' own input).
        self.timings: list = []
        self.replica.metrics = SimpleNamespace(timing=self.timings.append)
        self.prefill = SimpleNamespace(remote=self._call)
        self.transports: list[str | None] = []  # asked for, call by call

    def _call(self, request, have, tp, transport):
        self.transports.append(transport)
        return asyncio.ensure_future(self.replica.prefill(request, have, tp, transport))


class _FailsPulls(AsyncEngine):
    """Fails the pulls of the next `fail` handoffs, as a decode replica that NIXL cannot
    connect to its prefill replica does (the live pool's exports are object-store ones,
    which never fail a pull; the failure stands for a direct pull's)."""

    fail = 0

    def generate_prefilled(self, *args, **kw):
        if not self.fail:
            return super().generate_prefilled(*args, **kw)
        self.fail -= 1

        async def failed():
            raise KVTransferError("NIXL_ERR_REMOTE_DISCONNECT")
            yield

        return failed()


def test_a_handoff_decodes_as_one_engine_would_and_frees_its_budget_at_the_import(model_dir):
    async def main():
        alone = AsyncEngine(_engine(model_dir))
        prefill, decode = AsyncEngine(_engine(model_dir)), AsyncEngine(_engine(model_dir))
        try:
            want = [t for o in await _collect(alone, "alone", PROMPT) for t in o.new_token_ids]
            pool = _LivePrefillPool(prefill)
            handoff = _handoff(decode, pool)
            outputs = handoff.generate(_request(decode, PROMPT))
            first = await anext(outputs)
            # The prefill replica recorded its part of the request's time, ending at the
            # handoff (its decode part nothing).
            (timing,) = pool.timings
            assert timing.prefill_s > 0 and timing.decode_s == 0.0
            assert handoff.budget.used == 0  # the KV is in decode's blocks now
            got = first.new_token_ids + await _tokens(outputs)
            stats = handoff.stats
            assert got == want and stats.num_handoffs == 1 and stats.num_recomputed_tokens == 0
            assert stats.blocks_received == 3  # the whole prompt: decode held none of it
            # Closed after its first output, a request is aborted at once on decode, not
            # whenever its inner streams are garbage-collected.
            aborts, enqueue = [], decode._thread.abort
            decode._thread.abort = lambda abort: aborts.append(abort) or enqueue(abort)
            outputs = handoff.generate(_request(decode, PROMPT))
            await anext(outputs)
            await outputs.aclose()
            assert [a.request_id for a in aborts] == ["r"] and handoff.budget.used == 0
        finally:
            for engine in (alone, prefill, decode):
                await engine.shutdown()

    asyncio.run(main())


def test_a_request_that_waited_for_room_is_prefilled_here_if_the_pool_got_busy(model_dir):
    async def main():
        engine = AsyncEngine(_engine(model_dir))
        try:
            want = [t for o in await _collect(engine, "alone", PROMPT) for t in o.new_token_ids]
            pool = _PrefillPool(lambda r: r.set_exception(RayActorError()))
            handoff = _handoff(engine, pool, max_pending_prefills=1)
            budget = handoff.budget
            await budget.acquire(budget.capacity)
            decoding = asyncio.ensure_future(_tokens(handoff.generate(_request(engine, PROMPT))))
            await _until(lambda: budget.num_waiting == 1)
            handoff.selective.num_pending_prefills = 1  # meanwhile another request called the pool
            budget.release(budget.capacity)
            assert await decoding == want
            assert pool.calls == 0 and handoff.stats.num_local_prefills == 1
            assert budget.used == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_failed_pull_is_asked_again_through_the_object_store_and_a_run_pauses_direct(
    model_dir,
):
    async def main():
        prefill = AsyncEngine(_engine(model_dir))
        decode = _FailsPulls(_engine(model_dir, enable_prefix_caching=False))
        try:
            want = [t for o in await _collect(prefill, "alone", PROMPT) for t in o.new_token_ids]
            pool = _LivePrefillPool(prefill)
            handoff = _handoff(decode, pool)
            for _ in range(3):  # the third failed pull in a row pauses direct pulls
                decode.fail = 1
                assert await _tokens(handoff.generate(_request(decode, PROMPT))) == want
            assert pool.transports == [None, "object_store"] * 3
            stats = handoff.stats
            assert (stats.num_transfer_retries, stats.num_direct_pauses) == (3, 1)
            assert stats.num_handoffs == 3 and stats.num_recomputed_tokens == 0
            assert await _tokens(handoff.generate(_request(decode, PROMPT))) == want
            assert pool.transports[-1] == "object_store"  # asked at once while paused
        finally:
            for engine in (prefill, decode):
                await engine.shutdown()

    asyncio.run(main())


def test_a_failed_pull_retried_after_stale_prefixes_is_still_retried_not_recomputed(model_dir):
    async def main():
        prefill = AsyncEngine(_engine(model_dir))
        decode = _StaleThenFailed(_engine(model_dir))
        try:
            want = [t for o in await _collect(prefill, "alone", PROMPT) for t in o.new_token_ids]
            pool = _LivePrefillPool(prefill)
            handoff = _handoff(decode, pool)
            assert await _tokens(handoff.generate(_request(decode, PROMPT))) == want
            # Three stale tries, then a failed pull asked again through the object store:
            # its own retry, not one of the stale ones.
            assert pool.transports == [None] * 4 + ["object_store"]
            assert handoff.stats.num_recomputed_tokens == 0
        finally:
            for engine in (prefill, decode):
                await engine.shutdown()

    asyncio.run(main())


class _StaleThenFailed(AsyncEngine):
    """The first three imports find the prefix gone, the fourth pull fails."""

    calls = 0

    def generate_prefilled(self, *args, **kw):
        self.calls += 1
        if self.calls > 4:
            return super().generate_prefilled(*args, **kw)
        calls = self.calls

        async def failed():
            if calls <= 3:
                raise StalePrefixError("the prefix went", 0)
            raise KVTransferError("NIXL_ERR_REMOTE_DISCONNECT")
            yield

        return failed()


class _StaleTogether(AsyncEngine):
    """Each request's first import finds the prefix gone, once every one of `together`
    requests has reached its import: all then hold their first bytes of the budget."""

    together = 2

    def generate_prefilled(self, request_id, *args, **kw):
        if request_id in self.went_stale:
            return super().generate_prefilled(request_id, *args, **kw)
        self.went_stale.add(request_id)

        async def stale():
            while len(self.went_stale) < self.together:
                await asyncio.sleep(0.005)
            raise StalePrefixError("the prefix went", 0)
            yield

        return stale()


def test_concurrent_stale_retries_take_their_larger_budget_anew_and_all_finish(model_dir):
    async def main():
        prefill = AsyncEngine(_engine(model_dir))
        decode = _StaleTogether(_engine(model_dir))
        decode.went_stale = set()
        try:
            want = [t for o in await _collect(prefill, "alone", PROMPT) for t in o.new_token_ids]
            await _collect(decode, "cache", PROMPT)  # decode holds the two full blocks
            handoff = _handoff(decode, _LivePrefillPool(prefill))  # room for 3 blocks
            # Each asks for its last block (1 of 3), then, stale, for all 3: holding the
            # first while waiting for 2 more, the two would wait on each other for ever.
            requests = [replace(_request(decode, PROMPT), request_id=f"r{i}") for i in range(2)]
            streams = [_tokens(handoff.generate(r)) for r in requests]
            got = await asyncio.wait_for(asyncio.gather(*streams), 60)
            assert got == [want, want]
            assert handoff.stats.num_stale_retries == 2 and handoff.stats.num_handoffs == 2
            assert handoff.budget.used == 0
        finally:
            for engine in (prefill, decode):
                await engine.shutdown()

    asyncio.run(main())
