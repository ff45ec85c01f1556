"""serve_app/engine_server.py's own decisions, on a replica object built without Serve
(the request paths run end to end in test_service*.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from serve_app.engine_server import EngineServer


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
