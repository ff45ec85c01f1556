"""A handoff's KV moved to a decode engine's ranks before its request is added, within the
engine's pull budget (pull_budget.py says why there is one)."""

from __future__ import annotations

import asyncio

from workers.engine.handoff.pull_budget import PullBudget
from workers.engine.llm_engine import LLMEngine
from workers.kv.transport import KVPart


async def pull_kv(
    engine: LLMEngine, budget: PullBudget, kv_parts: list[KVPart]
) -> tuple[list[KVPart], int]:
    """A handoff's parts moved to this engine's ranks (`LLMEngine.prefetch_kv`) on a worker
    thread, once `budget` grants their size: the transfer never stalls other requests'
    steps, and one that fails (its exporter died) fails this request before it reaches the
    engine. Returns the parts to add and the bytes granted, for the caller to release at
    the import. Cancelled, the pull still finishes in its thread and what it staged is
    freed then (briefly beyond the budget, which is released at once: never a leak)."""
    nbytes = sum(p.nbytes for p in kv_parts)
    await budget.acquire(nbytes)
    pulling = asyncio.ensure_future(asyncio.to_thread(engine.prefetch_kv, kv_parts))
    try:
        await asyncio.shield(pulling)
    except BaseException as e:
        budget.release(nbytes)
        if isinstance(e, asyncio.CancelledError):
            pulling.add_done_callback(lambda f: _release_pulled(engine, f))
        raise
    return pulling.result(), nbytes


def _release_pulled(engine: LLMEngine, pulling: asyncio.Future) -> None:
    if not pulling.cancelled() and pulling.exception() is None:
        engine.release_prefetched_kv(pulling.result())
