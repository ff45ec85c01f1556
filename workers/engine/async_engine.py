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

This module is the caller side; the engine thread, its command queue and its lock are
its member `EngineThread` (engine_thread.py). Serving code reaches the engine only
through the methods here, never the `LLMEngine` itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from workers.engine.block_hash import BlockHash
from workers.engine.commands import Abort, Add, Call, Stream, next_output
from workers.engine.config import EngineConfig
from workers.engine.engine_thread import EngineThread
from workers.engine.handoff.decode_pull import pull_kv
from workers.engine.handoff.handle import KVHandle
from workers.engine.handoff.pull_budget import PullBudget
from workers.engine.kv_cache_manager import KVEventCallback
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import EngineStats, RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.kv.layout import KVLayout
from workers.kv.transport import KVPart, KVRef
from workers.model.config import ModelConfig
from workers.model.tokenizer import Tokenizer
from workers.torch_threads import run_in_passing_thread

DEFAULT_MAX_PENDING_REQUESTS = 1024

T = TypeVar("T")


class AsyncEngine:
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
        self._engine = engine
        self.stream_interval = stream_interval
        self.pull_budget = PullBudget(max_pulled_kv_bytes or max(engine.kv_cache_bytes // 4, 1))
        # Set once, read-only after: safe to share with callers on any thread.
        self.config: EngineConfig = engine.config
        self.model_config: ModelConfig = engine.model_config
        self.tokenizer: Tokenizer = engine.tokenizer
        self.num_kv_blocks: int = engine.kv.num_blocks
        self.kv_layout: KVLayout = engine.kv_layout
        self._thread = EngineThread(engine, max_pending_requests)

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

        return self._stream(request_id, len(prompt), submit, params)

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
            self._thread.check_room()  # a request refused anyway should not pay the transfer
            kv_parts, pulled = await pull_kv(self._engine, self.pull_budget, kv_parts)
        # The engine takes the parts at submit and drops them once imported; held here, they
        # would keep the export alive in the prefill ranks' memory until the last token.
        unsent = [kv_parts]
        del kv_parts

        def submit(engine: LLMEngine) -> None:
            parts = unsent.pop()
            engine.add_prefilled_request(request_id, prompt, params, handle, parts, cache_salt)

        stream = self._stream(request_id, len(prompt), submit, params)
        try:
            async for out in stream:
                if pulled:  # the first output comes after the import: the KV is in blocks
                    self.pull_budget.release(pulled)
                    pulled = 0
                yield out
        except Exception:
            if unsent:  # refused before reaching the engine (which frees what it is given)
                self._engine.release_prefetched_kv(unsent.pop())
            raise
        finally:
            if pulled:
                self.pull_budget.release(pulled)
            await stream.aclose()  # now, not at garbage collection: it aborts the request

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between steps and returns its result (or
        raises its exception): engine code run on its thread, for quick calls that have no
        method here."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        self._thread.call(Call(fn, reply, loop))
        return await reply

    async def _stream(
        self,
        request_id: str,
        num_prompt_tokens: int,
        submit: Callable[[LLMEngine], None],
        params: SamplingParams,
    ) -> AsyncIterator[RequestOutput]:
        if params.structured is not None:
            # Compiled here, on a worker thread: the engine thread finds it cached, and
            # a spec still compiling holds up no one else's step.
            await self._engine.grammars.prepare(params.structured)
        loop = asyncio.get_running_loop()
        stream = Stream(request_id, loop, num_prompt_tokens)
        self._thread.add(Add(stream, submit))
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
                self._thread.abort(Abort(request_id, stream=stream))

    async def abort(self, request_id: str) -> bool:
        """Aborts a request by id; True if it was running or waiting. Its generate() ends
        with a finished output whose finish_reason is ABORT."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        if not self._thread.abort(Abort(request_id, reply=reply, reply_loop=loop)):
            return False
        return await reply

    def abort_nowait(self, request_id: str) -> None:
        """Queues an abort without waiting (safe while being cancelled): drops a request or
        releases a held handoff."""
        self._thread.abort(Abort(request_id))

    # -- the KV handoff ------------------------------------------------------

    async def cached_prefix_blocks(
        self, block_hashes: list[BlockHash], token_ids: list[int], cache_salt: str | None = None
    ) -> int:
        """Decode side: how many of these leading full blocks the prefix cache holds now
        (a hint for the prefill side's `export_kv`; nothing is reserved)."""
        hashes, tokens = list(block_hashes), list(token_ids)
        return await self.call(lambda e: e.cached_prefix_blocks(hashes, tokens, cache_salt))

    async def export_kv(
        self,
        request_id: str,
        skip_blocks: int = 0,
        dst_tp: int | None = None,
        transport: str | None = None,
        release: bool = False,
    ) -> tuple[KVHandle, list[KVPart]]:
        """Prefill side: a held handoff's handle and its blocks (LLMEngine.export_kv). With
        `release`, the handoff is released in the same engine command, so its blocks go
        back to the pool even if the caller is cancelled while it waits for the copy."""

        def export(engine: LLMEngine) -> tuple[KVHandle, list[KVPart]]:
            exported = engine.export_kv(request_id, skip_blocks, dst_tp, transport)
            if release:
                engine.release_handoff(request_id)
            return exported

        return await self.call(export)

    def live_kv_exports(self) -> tuple[int, int]:
        """Prefill side, any thread (it waits on the TP ranks, if any: call it off the
        event loop): (objects, bytes) of exported KV an importer still references."""
        return self._engine.live_kv_exports()

    def resend_cached_blocks(self) -> None:
        """Any thread: the next step's KV events report every block the prefix cache
        holds, for a listener that lost what it was told (a replaced prefix registry)."""
        self._engine.resend_cached_blocks()

    # -- the replica ---------------------------------------------------------

    def rank_devices(self) -> str | None:
        """The GPUs of this engine's TP ranks (LLMEngine.rank_devices); waits on them."""
        return self._engine.rank_devices()

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step or command batch (never blocks on a step)."""
        return self._thread.stats()

    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self._engine.runner_failure() is None

    async def shutdown(self) -> None:
        """Aborts every request, stops the engine thread and shuts the engine down. Idempotent."""
        self._thread.request_stop()
        # Joining blocks for up to one step: keep the event loop free meanwhile. The first
        # caller to see the thread stopped shuts the engine down, once.
        if await asyncio.to_thread(self._thread.join):
            await asyncio.to_thread(self._engine.shutdown)
