"""A decode replica's way to a request's first token and KV: the handoff.

Decode drives it because it is the side that knows which blocks it already holds, so
only the rest ever travels: it asks the prefill pool for the first token and the blocks
past its cached prefix, imports them and decodes. A direct-transport pull that fails is
asked for once more through the object store (and a run of them pauses direct pulls:
handoff/transport_fallback.py). If the handoff fails (the prefill call fails, the pull fails,
or this replica evicted the prefix it reported on every try), it computes the prompt
itself, counted as a recompute and logged with its cause. It
also prefills a prompt itself by choice (selective disaggregation:
serve_app/handoff/selective_disaggregation.py decides), and every prompt while the
prefill pool has no running replica (degraded mode, `serve_app/pool_watch.py`).

A handoff's export is prefill memory (GPU memory on a GPU) until decode pulls it, and
with the object store it lands in this process whole: a replica asks for at most its KV
cache's worth of handoffs at once (`DecodeHandoff.budget`), more than it could import
anyway. (The engine's own pull budget then bounds what is pulled and not imported.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle

from serve_app.errors import root_cause
from serve_app.handoff.selective_disaggregation import SelectiveDisaggregation
from serve_app.handoff.transport_fallback import OBJECT_STORE, TransportFallback
from serve_app.metrics import ReplicaMetrics
from serve_app.pool_watch import REFRESH_S, PoolWatch
from serve_app.protocol import EngineRequest, PrefillResult
from workers.engine import (
    AsyncEngine,
    InvalidRequestError,
    KVRef,
    KVTransferError,
    PullBudget,
    RequestOutput,
    StalePrefixError,
)

logger = logging.getLogger(__name__)

# Decode may evict the prefix it counted on between asking for the blocks and importing
# them; it then asks again for more blocks, a bounded number of times.
_MAX_STALE_RETRIES = 3
# How long a request waits for the controller to confirm that the prefill pool has no
# running replica before it is prefilled here.
CONFIRM_S = 0.5


@dataclass
class HandoffStats:
    """What this decode replica's imports cost, in total (for status and metrics)."""

    num_handoffs: int = 0
    # Of those, the ones pulled straight from the prefill ranks (Ray Direct Transport).
    num_direct: int = 0
    num_bytes: int = 0
    blocks_received: int = 0
    # Export + transfer (including the call to the prefill pool, minus its prefill) + import.
    seconds: float = 0.0
    # The prefill pool's own compute for those requests, to set the handoff against.
    prefill_seconds: float = 0.0
    num_stale_retries: int = 0
    # Prompts this replica prefilled itself by choice (selective disaggregation) or for
    # want of a prefill replica, and the uncached prompt tokens it computed for them.
    num_local_prefills: int = 0
    local_prefill_tokens: int = 0
    # Degraded mode: whether the prefill pool had no running replica at the last request
    # or status post, and the prompts prefilled here for that reason (of the above).
    prefill_pool_down: bool = False
    num_degraded_prefills: int = 0
    # Prompt tokens this replica computed itself because the prefill pool failed it.
    num_recomputed_tokens: int = 0
    # Handoffs asked for again through the object store after their direct pull failed,
    # and the times direct pulls were paused after failing in a row (transport_fallback).
    num_transfer_retries: int = 0
    num_direct_pauses: int = 0
    # Why the last such handoff failed ("" if none did): for `baton status` and tests.
    last_failure: str = ""


class DecodeHandoff:
    """The handoff path of one decode replica, around its engine.

    `prefill_pool` makes actor calls (its result carries ObjectRefs to the exported KV,
    which must stay references); `block_bytes` is one block of the prefill pool's
    export, a KV-cache group's layers and all KV heads in its dtype."""

    def __init__(
        self,
        engine: AsyncEngine,
        prefill_pool: DeploymentHandle,
        prefill_watch: PoolWatch,
        metrics: ReplicaMetrics,
        *,
        block_size: int,
        block_bytes: int,
        local_prefill_tokens: int = 0,
        max_pending_prefills: int | None = None,
    ) -> None:
        self.engine, self.prefill_pool, self.metrics = engine, prefill_pool, metrics
        self.prefill_watch = prefill_watch
        metrics.degraded(False)
        self.block_size, self.block_bytes = block_size, block_bytes
        self.selective = SelectiveDisaggregation(local_prefill_tokens, max_pending_prefills)
        self.tp = engine.config.tensor_parallel_size
        self.stats = HandoffStats()
        self.fallback = TransportFallback()
        # As many blocks of the prefill pool's exports as this replica's KV cache holds.
        self.budget = PullBudget(engine.num_kv_blocks * block_bytes)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs: prefilled here or on the pool (see the module docstring)."""
        prompt = list(request.prompt_token_ids)
        have = await self.engine.cached_prefix_blocks(
            list(request.block_hashes), prompt, request.cache_salt
        )
        uncached = self._tokens_to_compute(request, have)
        if not await self.prefill_pool_running():
            # Degraded mode: a call now would wait for a replica to start, or fail.
            async with aclosing(self._prefill_here(request, prompt, uncached, True)) as outputs:
                async for out in outputs:
                    yield out
            return
        with _Reservation(self.budget) as reserved:
            remote = not self.selective.prefills_here(uncached)
            if remote:
                # At most a KV cache's worth of handoffs in flight (module docstring).
                await reserved.take(self._handoff_bytes(len(prompt), have))
                # Asked again after the wait for room: meanwhile enough prefill calls may
                # have gone out for this prompt to be better prefilled here.
                remote = not self.selective.prefills_here(uncached)
            if remote:
                outputs = self._handoff(request, prompt, have, reserved)
            else:
                reserved.release()  # no handoff after all
                outputs = self._prefill_here(request, prompt, uncached)
            # Closed with this generator, not at garbage collection: closing the engine
            # stream aborts the request and frees its blocks at once.
            async with aclosing(outputs):
                async for out in outputs:
                    yield out

    def _tokens_to_compute(self, request: EngineRequest, cached_blocks: int) -> int:
        """The prompt tokens a prefill here computes past `cached_blocks` held blocks: all
        of them for prompt logprobs (a cached position has no logits; only a transfer
        skips the blocks held here)."""
        if request.params.prompt_logprobs is not None:
            return len(request.prompt_token_ids)
        return len(request.prompt_token_ids) - cached_blocks * self.block_size

    async def prefill_pool_running(self) -> bool:
        """check_prefill_pool for a request deciding where to prefill: an answer of none
        running is asked again first (up to CONFIRM_S), so that no request goes degraded
        on an answer from before the pool started."""
        if not self.prefill_watch.has_running():
            await self.prefill_watch.refreshed(CONFIRM_S)
        return self.check_prefill_pool()

    def check_prefill_pool(self) -> bool:
        """Whether the prefill pool has a running replica (PoolWatch: as the controller
        last said), noting a change in the stats, the metrics and the log."""
        down = not self.prefill_watch.has_running()
        if down != self.stats.prefill_pool_down:
            self.stats.prefill_pool_down = down
            self.metrics.degraded(down)
            if down:
                logger.warning("the prefill pool has no running replica: prefilling here")
            else:
                logger.info("the prefill pool is running again: handing prompts off")
        return not down

    async def _prefill_here(
        self, request: EngineRequest, prompt: list[int], uncached: int, degraded: bool = False
    ) -> AsyncIterator[RequestOutput]:
        self.stats.num_local_prefills += 1
        self.stats.local_prefill_tokens += uncached
        self.stats.num_degraded_prefills += degraded
        self.metrics.local_prefill(degraded)
        stream = self.engine.generate(
            request.request_id, prompt, request.params, request.cache_salt
        )
        async with aclosing(stream):
            async for out in stream:
                yield out

    async def _handoff(
        self, request: EngineRequest, prompt: list[int], have: int, reserved: _Reservation
    ) -> AsyncIterator[RequestOutput]:
        """Prefill on the pool, import the blocks decode lacks, decode; recompute here if
        that fails. `reserved` is let go once the KV is in blocks or is not coming (with
        the request if the first token ended it)."""
        attempt, have = await self._first_output(request, prompt, have, reserved)
        if attempt.failure is not None:
            reserved.release()  # the KV is not coming
            if isinstance(attempt.failure, PrefillPoolDown):
                uncached = self._tokens_to_compute(request, have)
                outputs = self._prefill_here(request, prompt, uncached, degraded=True)
            else:
                outputs = self._recompute(request, attempt.failure, have)
            async with aclosing(outputs):
                async for out in outputs:
                    yield out
        elif attempt.rest is None:  # the first token ended the request: nothing to import
            yield attempt.first
        else:
            async with aclosing(attempt.rest):
                reserved.release()  # the first output comes after the import: KV in blocks
                yield attempt.first
                async for out in attempt.rest:
                    yield out

    async def _first_output(
        self, request: EngineRequest, prompt: list[int], have: int, reserved: _Reservation
    ) -> tuple[_Attempt, int]:
        """Attempts until one brings the first output or fails past retrying: that
        attempt, and the blocks of the prompt this replica then holds."""
        transport = self.fallback.transport()
        stale_tries = 0
        while True:
            attempt = await self._attempt(request, prompt, have, transport)
            failure = attempt.failure
            if isinstance(failure, StalePrefixError):
                stale_tries += 1
                self.stats.num_stale_retries += 1
                have = failure.num_cached_blocks
                if stale_tries <= _MAX_STALE_RETRIES:
                    # The next export starts earlier, so it is larger (`take` lets these
                    # bytes go before it waits). The attempt's export is gone already,
                    # so prefill frees it during the wait.
                    await reserved.take(self._handoff_bytes(len(prompt), have))
                    continue
                # Short of KV blocks, this replica evicted the prefix it reported on every
                # try: the prompt is computed here, which needs no prefix to stay put.
                stale = StalePrefixError(
                    "this decode replica evicted the prefix it reported on "
                    f"{_MAX_STALE_RETRIES + 1} tries; it is short of KV blocks",
                    have,
                )
                return _Attempt(failure=stale), have
            if isinstance(failure, KVTransferError) and transport is None:
                # The prefill replica died since it answered, or this transport cannot
                # reach it: once more through the object store (a prefix cache hit on a
                # live prefill replica), then the prompt is recomputed here.
                transport = OBJECT_STORE
                self.stats.num_transfer_retries += 1
                continue
            return attempt, have

    async def _attempt(
        self, request: EngineRequest, prompt: list[int], have: int, transport: str | None
    ) -> _Attempt:
        """One ask of the prefill pool for the first token and the blocks past the `have`
        this replica holds, and their import. The export (`result`) is referenced only in
        this call, so the prefill ranks free it (workers/kv/transport.py) once the attempt is
        over: not after the last token, nor through a retry or a recompute."""
        sent = time.perf_counter()
        result = await self._ask_pool(request, have, transport)
        if isinstance(result, Exception):
            return _Attempt(failure=result)
        received = time.perf_counter()
        if result.handle is None:
            return _Attempt(result.output)
        imported_s = self.engine.stats().kv_import_s
        pull_started = self.fallback.now()
        stream = self.engine.generate_prefilled(
            request.request_id,
            prompt,
            request.params,
            result.handle,
            result.kv_parts,
            request.cache_salt,
        )
        first = await _import_first(stream)
        if isinstance(first, KVTransferError):
            self.fallback.direct_pull_failed(first, pull_started)
            self.stats.num_direct_pauses = self.fallback.num_pauses
        if isinstance(first, Exception):
            return _Attempt(failure=first)  # a stream that raised has ended: none to close
        if any(isinstance(p, KVRef) for p in result.kv_parts):
            self.fallback.direct_pull_succeeded()
        self._count_handoff(result, received - sent, self.engine.stats().kv_import_s - imported_s)
        return _Attempt(first, stream)

    async def _ask_pool(
        self, request: EngineRequest, have: int, transport: str | None
    ) -> PrefillResult | Exception:
        """The prefill pool's answer, or why the call failed; raised instead if the request
        is over or at fault."""
        response = self.prefill_pool.prefill.remote(request, have, self.tp, transport)
        answer = asyncio.ensure_future(self.selective.pending(response))
        try:
            # A call made as the pool's last replica died waits in Serve's handle for a
            # new one: given up once the pool is seen to have none (degraded mode).
            while not (await asyncio.wait({answer}, timeout=REFRESH_S))[0]:
                if not await self.prefill_pool_running():
                    answer.cancel()
                    response.cancel()
                    return PrefillPoolDown("the prefill pool has no running replica")
            return answer.result()
        except asyncio.CancelledError:
            answer.cancel()
            response.cancel()  # the prefill replica aborts its request too
            raise
        except RequestCancelledError:
            # Serve cancels this call along with its parent request (the client left,
            # or its deadline passed), at times before this task sees its own cancel:
            # the request is over, the prefill pool did not fail it.
            raise
        except Exception as e:
            if isinstance(root_cause(e), InvalidRequestError):
                raise  # the request's fault: recomputing would fail alike
            return e

    def _handoff_bytes(self, num_tokens: int, have: int) -> int:
        """What prefill will export for a prompt of which this replica holds `have` blocks
        (of a sliding-window layer, only the blocks its window reaches)."""
        return self.engine.kv_layout.num_export_blocks(num_tokens, have) * self.block_bytes

    async def _recompute(
        self, request: EngineRequest, error: BaseException, cached_blocks: int
    ) -> AsyncIterator[RequestOutput]:
        """The handoff failed (a prefill replica died, none is reachable, the prefix kept
        going stale): this replica computes the prompt itself, visibly (log, counter,
        metric), past the `cached_blocks` it held when the request came."""
        prompt = list(request.prompt_token_ids)
        tokens = self._tokens_to_compute(request, cached_blocks)
        logger.warning(
            "request %s: KV handoff failed (%s: %s); recomputing %d prompt tokens here",
            request.request_id,
            type(root_cause(error)).__name__,
            root_cause(error),
            tokens,
        )
        self.stats.num_recomputed_tokens += tokens
        self.stats.last_failure = f"{type(root_cause(error)).__name__}: {root_cause(error)}"
        self.metrics.recompute(tokens)
        stream = self.engine.generate(
            request.request_id, prompt, request.params, request.cache_salt
        )
        async with aclosing(stream):
            async for out in stream:
                yield out

    def _count_handoff(self, result: PrefillResult, call_s: float, import_s: float) -> None:
        h = self.stats
        # The call's time minus prefill's own compute is what the handoff added.
        seconds = max(call_s - result.prefill_s, 0.0) + import_s
        h.num_handoffs += 1
        h.num_direct += any(isinstance(p, KVRef) for p in result.kv_parts)
        h.num_bytes += result.num_bytes
        h.blocks_received += sum(p.num_blocks for p in result.kv_parts[:1])
        h.seconds += seconds
        h.prefill_seconds += result.prefill_s
        self.metrics.handoff(result.num_bytes, seconds)


class PrefillPoolDown(RuntimeError):
    """A prefill call given up: the pool has no running replica to answer it."""


@dataclass
class _Attempt:
    """How one ask of the prefill pool went: the request's first output and, after an
    import, the stream of the rest (None if that output ended the request); or why not."""

    first: RequestOutput | None = None
    rest: AsyncIterator[RequestOutput] | None = None
    failure: Exception | None = None


async def _import_first(stream: AsyncIterator[RequestOutput]) -> RequestOutput | Exception:
    """The import's first output, or why the import failed. Caught here, not in
    `_attempt`: an error's traceback holds the frames it passed through, with their
    locals, and `_attempt`'s hold the export."""
    try:
        return await anext(stream)
    except (StalePrefixError, KVTransferError) as e:
        return e


class _Reservation:
    """Bytes of the handoff budget one request holds, from `take` until `release` (any
    number of calls) or the end of its `with` block."""

    def __init__(self, budget: PullBudget) -> None:
        self.budget, self.nbytes = budget, 0

    def __enter__(self) -> _Reservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    async def take(self, nbytes: int) -> None:
        """Holds `nbytes` instead, taken anew in line: waiting for more while holding
        what it has would deadlock with another request doing the same."""
        self.release()
        await self.budget.acquire(nbytes)
        self.nbytes = nbytes

    def release(self) -> None:
        if self.nbytes:
            self.budget.release(self.nbytes)
            self.nbytes = 0
