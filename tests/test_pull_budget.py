"""PullBudget (workers/engine/handoff/pull_budget.py): pulls wait, in order, for room;
nothing leaks on cancel."""

from __future__ import annotations

import asyncio
import threading

import pytest

from workers.engine.handoff.pull_budget import PullBudget


def test_pulls_within_the_budget_go_at_once_and_one_too_many_waits_for_a_release():
    async def main():
        budget = PullBudget(100)
        await budget.acquire(60)
        await budget.acquire(40)
        third = asyncio.ensure_future(budget.acquire(10))
        await asyncio.sleep(0.01)
        assert not third.done() and budget.num_waiting == 1
        budget.release(40)
        await asyncio.wait_for(third, 1)
        assert budget.used == 70 and budget.num_waiting == 0

    asyncio.run(main())


def test_waiters_are_served_in_arrival_order_so_a_big_pull_is_not_starved():
    async def main():
        budget = PullBudget(100)
        await budget.acquire(50)
        big = asyncio.ensure_future(budget.acquire(80))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(budget.acquire(10))  # would fit, but arrived later
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done()
        budget.release(50)
        await asyncio.wait_for(asyncio.gather(big, small), 1)
        assert budget.used == 90

    asyncio.run(main())


def test_a_pull_larger_than_the_whole_budget_goes_alone():
    async def main():
        budget = PullBudget(100)
        await budget.acquire(500)  # nothing else granted: it goes
        other = asyncio.ensure_future(budget.acquire(1))
        await asyncio.sleep(0.01)
        assert not other.done()
        budget.release(500)
        await asyncio.wait_for(other, 1)

    asyncio.run(main())


def test_a_cancelled_waiter_takes_nothing_and_lets_the_next_one_in():
    async def main():
        budget = PullBudget(100)
        await budget.acquire(90)
        blocked = asyncio.ensure_future(budget.acquire(50))
        await asyncio.sleep(0)
        behind = asyncio.ensure_future(budget.acquire(10))  # fits, but queued behind
        await asyncio.sleep(0.01)
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        await asyncio.wait_for(behind, 1)
        assert budget.used == 100 and budget.num_waiting == 0

    asyncio.run(main())


def test_a_grant_racing_a_cancel_is_given_back():
    async def main():
        budget = PullBudget(100)
        await budget.acquire(100)
        waiter = asyncio.ensure_future(budget.acquire(30))
        await asyncio.sleep(0.01)
        budget.release(100)  # grants the waiter; its wake-up is only scheduled
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert budget.used == 0

    asyncio.run(main())


def test_releases_from_another_thread_wake_waiters_on_their_own_loop():
    async def main():
        budget = PullBudget(10)
        await budget.acquire(10)
        waiter = asyncio.ensure_future(budget.acquire(5))
        await asyncio.sleep(0.01)
        threading.Thread(target=budget.release, args=(10,)).start()
        await asyncio.wait_for(waiter, 10)
        assert budget.used == 5

    asyncio.run(main())


def test_bad_sizes_and_over_releases_are_refused():
    with pytest.raises(ValueError, match="capacity"):
        PullBudget(0)
    budget = PullBudget(10)
    with pytest.raises(ValueError, match="nbytes"):
        asyncio.run(budget.acquire(-1))
    with pytest.raises(RuntimeError, match="only 0 are granted"):
        budget.release(1)
