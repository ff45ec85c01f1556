"""What the AsyncEngine tests share: sampling params, an engine on the tiny model, and waits.

Waits on background state poll with a deadline instead of sleeping a guessed amount.
"""

from __future__ import annotations

import asyncio
import time

from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=800, temperature=0.0, ignore_eos=True)
TIMEOUT = 30.0


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 256, **overrides}))


async def _collect(engine: AsyncEngine, rid: str, prompt, params=GREEDY):
    return [out async for out in engine.generate(rid, prompt, params)]


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def _all_blocks_free(engine: AsyncEngine) -> bool:
    s = engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks
