"""Model code runs at its configured torch thread count on whichever thread runs it:
AsyncEngine's engine thread here (OpenMP keeps the count per OS thread, and torch reads
it from the calling thread)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch
from async_engine_helpers import _engine

from workers.engine.async_engine import AsyncEngine


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
