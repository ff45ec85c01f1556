"""Serving threads in SCHED_BATCH, engine threads in SCHED_OTHER
(workers/engine/thread_policy.py), on this Linux process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import pytest
from engine_helpers import _engine

from workers.engine.async_engine import AsyncEngine
from workers.engine.thread_policy import run_as_engine_thread, yield_to_engine_threads

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
    reason="needs Linux's scheduling policies",
)


def _policies() -> dict[int, int]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out[int(tid)] = os.sched_getscheduler(int(tid))
    return out


@pytest.fixture
def batch_process():
    """This process's threads in SCHED_BATCH for the test, all back in SCHED_OTHER after."""
    yield
    for tid in _policies():
        with contextlib.suppress(OSError):
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))


def test_every_thread_yields_and_new_ones_inherit_it(batch_process):
    parked, release = threading.Event(), threading.Event()
    helper = threading.Thread(target=lambda: (parked.set(), release.wait()))
    helper.start()
    parked.wait()
    try:
        assert yield_to_engine_threads() >= 2
        assert set(_policies().values()) == {os.SCHED_BATCH}
        seen = []
        later = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        later.start()
        later.join()
        assert seen == [os.SCHED_BATCH]
    finally:
        release.set()
        helper.join()


def test_an_engine_thread_runs_in_the_normal_policy_among_batch_threads(batch_process, model_dir):
    yield_to_engine_threads()
    policy = []

    def engine_like():
        run_as_engine_thread()
        policy.append(os.sched_getscheduler(0))

    worker = threading.Thread(target=engine_like)
    worker.start()
    worker.join()
    assert policy == [os.SCHED_OTHER]
    assert os.sched_getscheduler(0) == os.SCHED_BATCH  # the caller's own stays

    async def main():
        engine = AsyncEngine(_engine(model_dir))
        try:
            # Asked on the engine thread itself, between steps.
            assert await engine.call(lambda _: os.sched_getscheduler(0)) == os.SCHED_OTHER
        finally:
            await engine.shutdown()

    asyncio.run(main())
