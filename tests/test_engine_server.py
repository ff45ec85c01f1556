"""serve_app/engine_server.py's own decisions, on a replica object built without Serve
(the request paths run end to end in test_service*.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from async_engine_helpers import GREEDY, _collect, _engine
from ray.exceptions import RayActorError

from serve_app.engine_server import EngineServer, HandoffStats
from serve_app.protocol import EngineRequest, PrefillResult
from workers.engine.async_engine import AsyncEngine
from workers.engine.block_hash import hash_full_blocks, root_hash
from workers.engine.kv_transfer import StalePrefixError
from workers.engine.outputs import RequestOutput


class _Replica(EngineServer):
    def __del__(self) -> None:  # Serve awaits the real one on shutdown; nothing to undo here
        pass


def _decode_replica(local_prefill_tokens: int, max_pending_prefills: int | None) -> EngineServer:
    replica = _Replica.__new__(_Replica)  # only the selective-disaggregation state
    replica.local_prefill_tokens = local_prefill_tokens
    replica.max_pending_prefills = max_pending_prefills
    replica._pending_prefills = 0
    return replica


@pytest.mark.parametrize(
    ("local_tokens", "max_pending", "pending", "uncached", "here"),
    [
        (0, None, 99, 1, False),  # pure disaggregation: every prompt goes to the pool
        (64, None, 0, 64, True),  # short enough
        (64, None, 0, 65, False),
        (0, 2, 1, 4096, False),  # the pool is not yet busy
        (0, 2, 2, 4096, True),  # it would queue this one behind two
        (64, 2, 2, 65, True),
    ],
)
def test_decode_prefills_itself_only_when_short_or_the_pool_is_busy(
    local_tokens, max_pending, pending, uncached, here
):
    replica = _decode_replica(local_tokens, max_pending)
    replica._pending_prefills = pending
    assert replica._prefills_here(uncached) is here


def test_a_prefill_call_counts_as_pending_until_it_answers_or_fails():
    replica = _decode_replica(0, 1)

    async def main():
        answer = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(replica._pending(answer))
        await asyncio.sleep(0)
        assert replica._pending_prefills == 1 and replica._prefills_here(4096)
        answer.set_result("result")
        assert await call == "result" and replica._pending_prefills == 0
        failing = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(replica._pending(failing))
        await asyncio.sleep(0)
        failing.set_exception(ConnectionError("the prefill replica died"))
        with pytest.raises(ConnectionError):
            await call
        assert replica._pending_prefills == 0 and not replica._prefills_here(4096)

    asyncio.run(main())


def test_a_replica_whose_engine_failed_withdraws_from_routing_and_the_registry_once():
    replica = _decode_replica(0, None)
    removed = []
    replica.role, replica.replica_id, replica._withdrawn = "decode", "r1", False
    replica.engine = SimpleNamespace(is_healthy=lambda: False)
    replica.registry = SimpleNamespace(remove_replica=SimpleNamespace(remote=removed.append))
    assert replica.record_routing_stats() == {"healthy": 0.0}
    assert replica.record_routing_stats() == {"healthy": 0.0}
    assert removed == ["r1"]


# The decode role's fallbacks, on a real in-process engine (tiny model) and a prefill
# pool that fails as Serve's handle would.
class _PrefillPool:
    def __init__(self, answer) -> None:
        self.calls = 0
        self.prefill = SimpleNamespace(remote=self._call)
        self._answer = answer

    def _call(self, request, have, tp):
        self.calls += 1
        response = asyncio.get_running_loop().create_future()
        self._answer(response)
        return response


class _AlwaysStale(AsyncEngine):
    """Evicts the reported prefix before every import, as a decode replica short of KV
    blocks would."""

    def generate_prefilled(self, request_id, prompt, params, handle, kv_parts, cache_salt=None):
        async def stale():
            raise StalePrefixError("the prefix went", 0)
            yield

        return stale()


def _decode_with(engine: AsyncEngine, pool: _PrefillPool, recomputed: list) -> EngineServer:
    replica = _decode_replica(0, None)
    replica.engine, replica.prefill_pool = engine, pool
    replica.block_size = engine.engine.config.block_size
    replica.engine_setup = {"tensor_parallel_size": 1}
    replica.handoff = HandoffStats()
    replica.metrics = SimpleNamespace(recompute=recomputed.append)
    return replica


def _request(engine: AsyncEngine, prompt: list[int]) -> EngineRequest:
    kv = engine.engine.kv  # hashed as the router hashes a prompt
    hashes = hash_full_blocks(prompt, kv.block_size, root_hash(kv.model_id, None))
    return EngineRequest("r", tuple(prompt), GREEDY, None, block_hashes=tuple(hashes))


def test_a_failed_prefill_call_is_recomputed_on_decode_with_the_same_output(model_dir):
    prompt = list(range(5, 45))
    recomputed = []

    async def main():
        engine = AsyncEngine(_engine(model_dir))
        try:
            want = [t for o in await _collect(engine, "alone", prompt) for t in o.new_token_ids]
            dead = _PrefillPool(lambda r: r.set_exception(RayActorError()))
            replica = _decode_with(engine, dead, recomputed)
            got = [
                t async for o in replica._decode(_request(engine, prompt)) for t in o.new_token_ids
            ]
            return want, got, replica.handoff
        finally:
            await engine.shutdown()

    want, got, handoff = asyncio.run(main())
    assert got == want
    # The prompt's two full blocks were cached by the run alone: only the rest is redone.
    assert handoff.num_recomputed_tokens == recomputed[0] == len(prompt) - 2 * 16
    assert "RayActorError" in handoff.last_failure


def test_a_prefix_that_goes_stale_on_every_try_is_recomputed_not_failed(model_dir):
    prompt = list(range(5, 45))
    recomputed = []

    async def main():
        engine = _AlwaysStale(_engine(model_dir))
        try:
            want = [t for o in await _collect(engine, "alone", prompt) for t in o.new_token_ids]
            first = RequestOutput("r", [want[0]], "", num_prompt_tokens=len(prompt))
            handle = SimpleNamespace()  # never read: the import is refused first
            answer = PrefillResult(first, handle, [], prefill_s=0.0)
            pool = _PrefillPool(lambda r: r.set_result(answer))
            replica = _decode_with(engine, pool, recomputed)
            got = [
                t async for o in replica._decode(_request(engine, prompt)) for t in o.new_token_ids
            ]
            return want, got, replica.handoff, pool.calls
        finally:
            await engine.shutdown()

    want, got, handoff, calls = asyncio.run(main())
    assert got == want and calls == 4  # the first try and three retries
    assert handoff.num_stale_retries == 4 and "StalePrefixError" in handoff.last_failure
    assert recomputed == [len(prompt)]  # the last stale answer said 0 blocks held
