"""What callers hand an AsyncEngine's engine thread, and how its results travel back.

Commands (`Add`, `Call`, `Abort`) are queued under the AsyncEngine's lock and run on the
engine thread between steps; outputs and replies go back to each caller's own event
loop with `call_soon`, which never blocks the engine thread; `fail_all` tells everyone
when that thread has failed. On the caller's side, `next_output` turns what a stream's
queue holds into the next message it yields.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from workers.engine.handoff.handle import KVHandle
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import RequestOutput, merge_outputs
from workers.engine.sequence import FinishReason
from workers.errors import EngineDeadError, dead_error


@dataclass(eq=False)  # identity semantics: a stream is compared with `is`, never by value
class Stream:
    """One generate() call: where its outputs go and what it has seen so far."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    num_prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Updated on the engine thread only, to describe an abort in its final output.
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # The handoff its last output held (a prefill-only request), for a late abort to free.
    handoff: KVHandle | None = None


@dataclass
class Add:
    stream: Stream
    # Queues the request in the engine (add_request or add_prefilled_request); raises
    # (ValueError, naming the field) before changing anything if the engine refuses it.
    submit: Callable[[LLMEngine], None]


@dataclass
class Call:
    fn: Callable[[LLMEngine], Any]
    reply: asyncio.Future
    reply_loop: asyncio.AbstractEventLoop


@dataclass
class Abort:
    request_id: str
    # Set: abort only if this exact stream is still live (a consumer walking away must
    # not abort a later request that reuses its id). None: abort whatever has the id.
    stream: Stream | None = None
    # Set for abort(): resolved with whether anything was aborted.
    reply: asyncio.Future | None = None
    reply_loop: asyncio.AbstractEventLoop | None = None


async def next_output(
    stream: Stream, item: RequestOutput, min_tokens: int
) -> tuple[RequestOutput, BaseException | None]:
    """`item` merged with the outputs that followed it: all those already queued, then,
    while the merge holds fewer than `min_tokens` tokens, more as they arrive, stopping
    at the request's last output. An exception met on the way comes back second, to be
    raised after the merged output is delivered.

    A consumer that fell behind thus gets what piled up as one output: fewer, larger
    messages down the serving path exactly when it is busiest.
    """
    batch = [item]
    num_tokens = len(item.new_token_ids)
    error: BaseException | None = None
    while not batch[-1].finished:
        if not stream.queue.empty():
            nxt = stream.queue.get_nowait()
        elif num_tokens < min_tokens:
            nxt = await stream.queue.get()
        else:
            break
        if isinstance(nxt, BaseException):
            error = nxt
            break
        batch.append(nxt)
        num_tokens += len(nxt.new_token_ids)
    return (batch[0] if len(batch) == 1 else merge_outputs(batch)), error


def abort_output(stream: Stream) -> RequestOutput:
    return RequestOutput(
        stream.request_id,
        [],
        "",
        finished=True,
        finish_reason=FinishReason.ABORT,
        num_prompt_tokens=stream.num_prompt_tokens,
        num_output_tokens=stream.num_output_tokens,
        num_cached_tokens=stream.num_cached_tokens,
    )


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed
        return False
    return True


def deliver(items: list[tuple[Stream, object]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():  # the awaiting task may have been cancelled
        future.set_result(value)


def fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def fail_all(
    streams: Iterable[Stream], queued: list[Add | Abort | Call], error: EngineDeadError
) -> None:
    """After the engine thread failed: every live stream and every queued command learns
    it. Only delivers, never touches the broken engine."""
    batches: dict[asyncio.AbstractEventLoop, list] = {}
    # An add that already ran is both live and queued (its batch failed): fail it once.
    unique = {id(s): s for s in streams}
    unique.update({id(c.stream): c.stream for c in queued if isinstance(c, Add)})
    for stream in unique.values():
        batches.setdefault(stream.loop, []).append((stream, dead_error(error)))
    for command in queued:
        if isinstance(command, Abort) and command.reply is not None and command.reply_loop:
            call_soon(command.reply_loop, resolve, command.reply, False)
        elif isinstance(command, Call):
            call_soon(command.reply_loop, fail, command.reply, dead_error(error))
    for loop, items in batches.items():
        call_soon(loop, deliver, items)
