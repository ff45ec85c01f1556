"""serve_app/handoff/selective_disaggregation.py: when a decode replica prefills a prompt itself,
and how it counts the prefill calls it waits on (its use on the handoff path:
test_decode_handoff.py; live: test_service_selective.py)."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.handoff.selective_disaggregation import SelectiveDisaggregation


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
    selective = SelectiveDisaggregation(local_tokens, max_pending)
    selective.num_pending_prefills = pending
    assert selective.prefills_here(uncached) is here


def test_a_prefill_call_counts_as_pending_until_it_answers_or_fails():
    async def main():
        selective = SelectiveDisaggregation(max_pending_prefills=1)
        answer = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(selective.pending(answer))
        await asyncio.sleep(0)
        assert selective.num_pending_prefills == 1 and selective.prefills_here(4096)
        answer.set_result("result")
        assert await call == "result" and selective.num_pending_prefills == 0
        failing = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(selective.pending(failing))
        await asyncio.sleep(0)
        failing.set_exception(ConnectionError("the prefill replica died"))
        with pytest.raises(ConnectionError):
            await call
        assert selective.num_pending_prefills == 0 and not selective.prefills_here(4096)

    asyncio.run(main())
