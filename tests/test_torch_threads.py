"""Model code runs at its configured torch thread count on whichever thread runs it:
AsyncEngine's engine thread here (torch keeps the count per OS thread)."""

from __future__ import annotations

import asyncio
import time

import torch
from async_engine_helpers import _engine

from workers.engine.async_engine import AsyncEngine


def _cores_busy() -> float:
    """CPU seconds per wall second of a matmul loop: ~1 at one torch thread, ~2 at two."""
    a, w = torch.randn(64, 576), torch.randn(4096, 576)
    torch.nn.functional.linear(a, w)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(150):
        torch.nn.functional.linear(a, w)
    return (time.process_time() - cpu) / (time.perf_counter() - start)


def test_the_engine_thread_computes_at_the_engines_thread_count(model_dir):
    async def main():
        # Built on this thread, stepped on the engine's own: one thread means one core.
        engine = AsyncEngine(_engine(model_dir, num_threads=1))
        try:
            return await engine.call(lambda _: _cores_busy())
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) < 1.4
