"""Model code runs at its configured torch thread count on whichever thread runs it:
AsyncEngine's engine thread here (OpenMP keeps the count per OS thread, and torch reads
it from the calling thread)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from engine_helpers import _engine

from workers.engine.async_engine import AsyncEngine
from workers.torch_threads import (
    kernel_threads,
    kernels_apart,
    one_thread,
    run_in_passing_thread,
    use_num_threads,
)


def test_the_engine_thread_computes_at_the_engines_thread_count(model_dir):
    with ThreadPoolExecutor(1) as pool:  # what a new thread runs at unless told otherwise
        default = pool.submit(torch.get_num_threads).result()
    configured = 1 if default != 1 else 2

    async def main():
        # Built on this thread, stepped on the engine's own.
        engine = AsyncEngine(_engine(model_dir, num_threads=configured))
        try:
            return await engine.call(lambda _: torch.get_num_threads())
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == configured


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_op() -> float:
    torch.set_num_threads(2)
    # A pointwise op big enough for ATen's OpenMP parallel_for to start its workers.
    return float(torch.full((1 << 22,), 0.5).exp().sum())


def test_a_passing_thread_takes_its_openmp_workers_with_it():
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()  # the pool's own thread, before counting
        before = _os_threads()
        pool.submit(_parallel_op).result()
        # A thread that stays keeps the OpenMP worker its op started.
        assert _os_threads() > before

        settled = _os_threads()
        value = run_in_passing_thread(_parallel_op)
        assert isinstance(value, float)
        deadline = time.monotonic() + 5
        while _os_threads() > settled and time.monotonic() < deadline:
            time.sleep(0.01)  # the workers exit just after their thread does
        assert _os_threads() == settled


def test_a_passing_thread_returns_the_result_or_raises_the_error():
    caller = threading.get_ident()
    assert run_in_passing_thread(threading.get_ident) != caller
    with pytest.raises(KeyError, match="missing"):
        run_in_passing_thread(lambda: {}["missing"])


def test_one_thread_runs_the_block_on_one_thread_and_restores_the_count():
    def on_a_thread_of_its_own():
        use_num_threads(2)
        seen = []
        with one_thread():
            seen.append(torch.get_num_threads())
        with pytest.raises(KeyError), one_thread():
            raise KeyError("the count comes back after an error too")
        return seen, torch.get_num_threads()

    assert run_in_passing_thread(on_a_thread_of_its_own) == ([1], 2)


def test_kernels_apart_leaves_torch_one_thread_and_the_kernels_the_count():
    def on_a_thread():
        use_num_threads(2)
        before = kernel_threads()
        with kernels_apart():
            inside = (kernel_threads(), torch.get_num_threads())
        return before, inside, (kernel_threads(), torch.get_num_threads())

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(on_a_thread).result() == (2, (2, 1), (2, 2))
