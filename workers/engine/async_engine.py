"""The asyncio face of one `LLMEngine`: what a Ray Serve replica holds.

The engine is not thread-safe, so exactly one background thread touches it. Callers
never call the engine: they append commands (add, abort) to a queue under a lock,
and the engine thread runs them between steps. That keeps every engine call on one
thread without making event-loop code wait for a step to finish, and it keeps the
order of commands (an abort queued after an add always sees the add).

Outputs travel back to each caller's own event loop with `call_soon_threadsafe`, one
call per loop per step. torch releases the GIL inside its kernels, so the event loop
stays responsive while the engine thread computes.

Failure policy: an exception from the engine thread (a bug, or a dead TP rank
surfacing as RuntimeError) may have left the engine half-updated, so the engine is
never touched again. Every in-flight and queued request fails with `EngineDeadError`,
`is_healthy()` turns False so the serving layer's health check replaces the replica,
and new requests are refused at once.

This module is the caller side; the engine thread's own loop is its base class
`EngineThread` (engine_thread.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from workers.engine.async_commands import (
    Abort,
    Add,
    Call,
    Stream,
    next_output,
    pull_kv,
)
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.engine_thread import EngineThread
from workers.engine.errors import EngineDeadError, EngineOverloadedError
from workers.engine.kv_cache_manager import KVEventCallback
from workers.engine.kv_transfer import KVHandle
from workers.engine.kv_transport import KVPart, KVRef
from workers.engine.outputs import EngineStats, RequestOutput
from workers.engine.pull_budget import PullBudget
from workers.engine.sampling_params import SamplingParams
from workers.torch_threads import run_in_passing_thread

DEFAULT_MAX_PENDING_REQUESTS = 1024

T = TypeVar("T")


class AsyncEngine(EngineThread):
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_pending_requests: int | None = DEFAULT_MAX_PENDING_REQUESTS,
        stream_interval: int = 1,
        max_pulled_kv_bytes: int | None = None,
    ):
        """Starts the engine thread. `max_pending_requests` bounds the requests accepted but
        not yet running (None: unbounded); beyond it generate() raises EngineOverloadedError.
        `stream_interval`: past its first output, a stream yields once it holds that many new
        tokens (or the request ended), merged: fewer messages for a serving path that pays
        per message (Ray Serve's hops), at the cost of smoothness. `max_pulled_kv_bytes`:
        handoff KV pulled and waiting for its import, at most (see pull_budget.py); None:
        a quarter of this engine's KV cache (on a GPU it waits in device memory).
        """
        if max_pending_requests is not None and max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {max_pending_requests}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        if max_pulled_kv_bytes is not None and max_pulled_kv_bytes < 1:
            raise ValueError(f"max_pulled_kv_bytes must be >= 1, got {max_pulled_kv_bytes}")
        self.engine = engine
        self.max_pending_requests = max_pending_requests
        self.stream_interval = stream_interval
        self.pull_budget = PullBudget(max_pulled_kv_bytes or max(engine.kv_cache_bytes // 4, 1))
        self._cond = threading.Condition()
        # Everything below is guarded by _cond.
        self._commands: list[Add | Abort | Call] = []
        self._commands_running: list[Add | Abort | Call] = []
        self._num_queued_adds = 0  # adds not yet reflected in _stats.num_waiting
        self._stats = engine.stats()  # safe: the engine thread does not exist yet
        self._stopping = False
        self._engine_shut_down = False
        self._error: EngineDeadError | None = None
        # Touched by the engine thread only.
        self._streams: dict[str, Stream] = {}
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls, config: EngineConfig, on_kv_events: KVEventCallback | None = None, **options
    ) -> AsyncEngine:
        """Builds the LLMEngine (loads the model: blocking) and wraps it; `options` are
        __init__'s. The loading runs on a passing thread, so that the engine thread's
        OpenMP workers are the only ones left (workers/torch_threads.py says why)."""
        engine = run_in_passing_thread(lambda: LLMEngine(config, on_kv_events=on_kv_events))
        return cls(engine, **options)

    # -- caller side (any thread, any event loop) ----------------------------

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prefill_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Yields this request's outputs as the engine makes them, ending with a finished one.

        Raises before yielding anything if the request is refused: ValueError (invalid, from
        add_request), EngineOverloadedError, EngineDeadError. Raises EngineDeadError mid-stream
        if the engine fails. Closing the iterator or cancelling its task aborts the request.
        A request aborted via abort() or shutdown() ends with finish_reason ABORT.
        `prefill_only`: see LLMEngine.add_request (its last output carries the handoff).
        """
        prompt = list(prompt_token_ids)

        def submit(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, cache_salt, prefill_only)

        return self._stream(request_id, len(prompt), submit)

    async def generate_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        handle: KVHandle,
        kv_parts: list[KVPart],
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Like generate(), for a request another engine prefilled (LLMEngine
        .add_prefilled_request); its first output repeats the handed-over token."""
        prompt = list(prompt_token_ids)
        pulled = 0  # bytes of the pull budget this request holds until its import
        if any(isinstance(p, KVRef) for p in kv_parts):
            with self._cond:
                self._check_room()  # a request refused anyway should not pay the transfer
            kv_parts, pulled = await pull_kv(self.engine, self.pull_budget, kv_parts)
        # The engine takes the parts at submit and drops them once imported; held here, they
        # would keep the export alive in the prefill ranks' memory until the last token.
        unsent = [kv_parts]
        del kv_parts

        def submit(engine: LLMEngine) -> None:
            parts = unsent.pop()
            engine.add_prefilled_request(request_id, prompt, params, handle, parts, cache_salt)

        stream = self._stream(request_id, len(prompt), submit)
        try:
            async for out in stream:
                if pulled:  # the first output comes after the import: the KV is in blocks
                    self.pull_budget.release(pulled)
                    pulled = 0
                yield out
        except (EngineOverloadedError, EngineDeadError):
            if unsent:  # refused before reaching the engine (which frees what it is given)
                self.engine.release_prefetched_kv(unsent.pop())
            raise
        finally:
            if pulled:
                self.pull_budget.release(pulled)
            await stream.aclose()  # now, not at garbage collection: it aborts the request

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between steps and returns its result (or
        raises its exception). For quick engine calls: export_kv, cached_prefix_blocks..."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        with self._cond:
            self._check_alive()
            self._commands.append(Call(fn, reply, loop))
            self._cond.notify()
        return await reply

    async def _stream(
        self, request_id: str, num_prompt_tokens: int, submit: Callable[[LLMEngine], None]
    ) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        stream = Stream(request_id, loop, num_prompt_tokens)
        with self._cond:
            self._check_room()
            self._num_queued_adds += 1
            self._commands.append(Add(stream, submit))
            self._cond.notify()
        finished = False
        first = True
        pending: BaseException | None = None
        try:
            while True:
                item = pending if pending is not None else await stream.queue.get()
                pending = None
                if isinstance(item, BaseException):
                    finished = True  # refused or failed: nothing left in the engine
                    raise item
                # Past the first output, a stream also waits for `stream_interval` tokens.
                out, pending = await next_output(stream, item, 0 if first else self.stream_interval)
                finished, first = out.finished, False
                yield out
                if finished:
                    return
        finally:
            if not finished:
                # Consumer gone (closed, cancelled, client disconnect): free the blocks.
                # Queued, not awaited: awaiting is unsafe while being cancelled.
                self._enqueue_abort(Abort(request_id, stream=stream))

    def _check_room(self) -> None:
        """EngineDeadError or EngineOverloadedError unless a new request may queue; call
        with the lock held."""
        self._check_alive()
        limit = self.max_pending_requests
        if limit is not None and self._stats.num_waiting + self._num_queued_adds >= limit:
            raise EngineOverloadedError(
                f"{limit} requests are already waiting for this engine; retry later"
            )

    async def abort(self, request_id: str) -> bool:
        """Aborts a request by id; True if it was running or waiting. Its generate() ends
        with a finished output whose finish_reason is ABORT."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        if not self._enqueue_abort(Abort(request_id, reply=reply, reply_loop=loop)):
            return False
        return await reply

    def abort_nowait(self, request_id: str) -> None:
        """Queues an abort without waiting (safe while being cancelled): drops a request or
        releases a held handoff."""
        self._enqueue_abort(Abort(request_id))

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step or command batch (never blocks on a step)."""
        with self._cond:
            return self._stats

    def is_healthy(self) -> bool:
        with self._cond:
            alive = self._error is None and not self._stopping and self._thread.is_alive()
        return alive and self.engine.runner_failure() is None

    async def shutdown(self) -> None:
        """Aborts every request, stops the engine thread and shuts the engine down. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        # Joining blocks for up to one step: keep the event loop free meanwhile.
        await asyncio.to_thread(self._thread.join)
        with self._cond:  # engine.shutdown() once, however many callers
            first, self._engine_shut_down = not self._engine_shut_down, True
        if first:
            await asyncio.to_thread(self.engine.shutdown)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(str(self._error)) from self._error.__cause__
        if self._stopping:
            raise EngineDeadError("the engine is shut down")

    def _enqueue_abort(self, command: Abort) -> bool:
        with self._cond:
            if self._error is not None or self._stopping:
                return False  # nothing is live any more (or shutdown aborts it)
            self._commands.append(command)
            self._cond.notify()
            return True
