"""Fan-in of several async streams: one OpenAI request with `n` choices is `n` engine
requests whose outputs reach the client interleaved, as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

_END = object()


@dataclass(frozen=True)
class _Failed:
    error: BaseException


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of `streams` as they arrive, each with its stream's index. A stream that
    fails ends the merge with its error; a merge that fails or is closed (the client
    left) cancels every stream still running, so each can free what it holds."""
    if len(streams) == 1:  # the usual request: no tasks, no queue
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield index, item
    finally:
        # Not awaited: this may run while the consumer is being cancelled. Each stream's
        # own cancellation handling runs on the loop right after.
        for task in tasks:
            task.cancel()


async def _pump(index: int, stream: AsyncIterator, queue: asyncio.Queue) -> None:
    try:
        async for item in stream:
            queue.put_nowait((index, item))
    except BaseException as e:
        # CancelledError too: Serve ends a stream whose replica call was cancelled with
        # one of its own, and the merge must hear of it rather than wait for ever.
        queue.put_nowait((index, _Failed(e)))
        raise
    queue.put_nowait((index, _END))
