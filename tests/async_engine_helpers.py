"""What the AsyncEngine tests share: sampling params and waits (greedy params and the
engine on the tiny model: engine_helpers.py).

Waits on background state poll with a deadline instead of sleeping a guessed amount.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from engine_helpers import GREEDY

from workers.engine.async_engine import AsyncEngine
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=800, temperature=0.0, ignore_eos=True)
TIMEOUT = 30.0


async def _collect(engine: AsyncEngine, rid: str, prompt, params=GREEDY, read=None):
    """Every output of one stream; `read(rid)` after each (see `hold_steps_until_read`)."""
    outs = []
    async for out in engine.generate(rid, prompt, params):
        outs.append(out)
        if read is not None:
            read(rid)
    return outs


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def _all_blocks_free(engine: AsyncEngine) -> bool:
    s = engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks


def hold_steps_until_read(
    engine: LLMEngine, held: Callable[[RequestOutput], bool]
) -> Callable[[str], None]:
    """Makes `engine` start each step only once the consumer has read every output of the
    previous step that `held` selects; returns the consumer's `read(request_id)`.

    A consumer slower than the engine thread gets its backlog merged into one output (by
    design), so a test of how outputs are grouped holds the engine to its consumers' pace:
    what it checks is then the grouping rule, not how busy the machine was.
    """
    cond = threading.Condition()
    unread: set[str] = set()
    step = engine.step

    def held_step() -> list[RequestOutput]:
        with cond:
            if not cond.wait_for(lambda: not unread, TIMEOUT):
                raise RuntimeError(f"outputs never read by {sorted(unread)}")
        outputs = step()
        with cond:
            unread.update(o.request_id for o in outputs if held(o))
        return outputs

    def read(request_id: str) -> None:
        with cond:
            unread.discard(request_id)  # one read covers every earlier output (merged)
            cond.notify()

    engine.step = held_step
    return read
