"""One engine replica of a pool: the Ray Serve deployment class behind every pool.

A replica owns an `AsyncEngine` (its TP ranks, if any, are Ray actors of their own) and
plays one role:

- "aggregated": `generate` runs the whole request here (its outputs go to the router on
  the call or on the router's subscription, `serve_app/streaming/output_channels.py`);
- "prefill": `prefill` computes the prompt, samples the first token and returns it with
  the KV blocks the caller lacks (the blocks are released here as they leave);
- "decode": `generate` gets the first token and the blocks it lacks from the prefill
  pool, imports them and decodes (`handoff/decode_handoff.py`: the handoff and its fallbacks;
  `serve_app/handoff/selective_disaggregation.py`: when it prefills a prompt itself instead).

Each replica publishes its prefix cache's stored/evicted block hashes to the prefix
registry, and its load and KV usage to Serve's request router (`record_routing_stats`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import asdict

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.gpu_telemetry import read_gpus, replica_gpus
from serve_app.handoff.decode_handoff import DecodeHandoff, HandoffStats
from serve_app.metrics import ReplicaMetrics
from serve_app.pool_watch import PoolWatch
from serve_app.protocol import EngineRequest, PrefillResult, StreamStart, Subscription
from serve_app.routing.prefix_registry import HEARTBEAT_S, get_or_create_registry
from serve_app.serve_config import DEPLOYMENT_NAMES
from serve_app.status_board import get_or_create_board
from serve_app.streaming.channel_server import ChannelServer
from serve_app.streaming.output_channels import OutputChannels
from workers.engine import (
    AsyncEngine,
    BlockHash,
    EngineDeadError,
    FinishReason,
    RequestOutput,
    kv_cache_bytes_per_block,
    yield_to_engine_threads,
)
from workers.model import model_identity

logger = logging.getLogger(__name__)

ROLES = ("aggregated", "prefill", "decode")


class EngineServer:
    def __init__(self, config: AppConfig, role: str, prefill_pool: DeploymentHandle | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if (role == "decode") != (prefill_pool is not None):
            raise ValueError("a decode replica needs the prefill pool's handle; others none")
        self.role = role
        # Before the engine's thread starts: it alone stays in the normal policy, so the
        # serving threads its tokens wake do not preempt it (workers/engine/thread_policy.py).
        yield_to_engine_threads()
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.app_name = context.app_name
        pool = config.pools()[role]
        model_dir = config.model_dir()
        self.metrics = ReplicaMetrics(
            context.app_name, role, self.replica_id, config.served_name(model_dir)
        )
        engine_config = config.engine_config(pool, str(model_dir), model_identity(model_dir))
        # The one the application's routers ask: its own unless the config names one.
        self.registry_config = config.prefix_registry(context.app_name)
        self.board_name = config.status_board_name
        self.registry = get_or_create_registry(self.registry_config)
        self.board = get_or_create_board(self.board_name)
        # The last fire-and-forget call to each (see _replace_lost_actors).
        self._last_publish: Future | None = None
        self._registry_session: str | None = None  # what the last checked publish returned
        self._last_post: Future | None = None
        self._withdrawn = False  # from routing and the registry, its engine failed
        self._last_heartbeat = time.monotonic()  # to the registry (see record_routing_stats)
        self.engine = AsyncEngine.from_config(
            engine_config,
            stream_interval=config.stream_interval,
            max_pulled_kv_bytes=pool.max_pulled_kv_bytes,
            on_kv_events=self._publish,
        )
        # A TP replica's GPUs are its ranks' (on its node: one placement group).
        self._visible_gpus = (
            self.engine.rank_devices()
            if pool.tensor_parallel_size > 1 and pool.num_gpus > 0
            else None
        )
        self.gpus = replica_gpus(pool.num_gpus, self._visible_gpus)
        self.decode = None if prefill_pool is None else self._decode_handoff(config, prefill_pool)
        self.channels = OutputChannels(self.replica_id)
        # Started by the first generate call, on the event loop that fills the channels.
        self.channel_server = ChannelServer(self.channels, ray.util.get_node_ip_address())
        self.engine_setup = {
            "dtype": engine_config.resolved_dtype_name(),
            "tensor_parallel_size": engine_config.tensor_parallel_size,
            "activations": engine_config.activations,
        }
        logger.info("%s replica %s ready (%s)", role, self.replica_id, model_dir)

    def _decode_handoff(self, config: AppConfig, prefill_pool: DeploymentHandle) -> DecodeHandoff:
        # One block of the prefill pool's export: a KV-cache group's layers and all KV
        # heads, in its dtype.
        prefill = config.engine_config(config.prefill, str(config.model_dir()), None)
        block_bytes = kv_cache_bytes_per_block(
            self.engine.model_config, config.block_size, prefill.resolved_dtype()
        )
        return DecodeHandoff(
            self.engine,
            # An actor call whatever Serve's default channel (RAY_SERVE_USE_GRPC_BY_DEFAULT):
            # its result carries ObjectRefs to the exported KV, which must stay references.
            prefill_pool.options(_by_reference=True),
            PoolWatch(DEPLOYMENT_NAMES["prefill"]),
            self.metrics,
            block_size=config.block_size,
            block_bytes=block_bytes,
            local_prefill_tokens=config.local_prefill_tokens,
            max_pending_prefills=config.max_pending_prefills,
        )

    def _publish(self, stored: list[BlockHash], evicted: list[BlockHash]) -> None:
        # Runs on the engine thread once per step: hand the batch off, never wait.
        self._last_publish = self.registry.publish.remote(self.replica_id, stored, evicted).future()

    # -- requests --------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamStart | RequestOutput]:
        """A `StreamStart`, then the request's outputs unless they go to the router's
        subscription (aggregated and decode roles; see serve_app/streaming/output_channels.py)."""
        if self.role == "prefill":
            raise ValueError("a prefill replica runs prefill(), not generate()")
        if self.role == "decode":
            outputs = self.decode.generate(request)
        else:
            outputs = self.engine.generate(
                request.request_id,
                list(request.prompt_token_ids),
                request.params,
                request.cache_salt,
            )
        await self.channel_server.start()
        async for item in self.channels.stream(request.router_id, self._timed(outputs)):
            yield item

    async def _timed(self, outputs: AsyncIterator) -> AsyncIterator:
        """The outputs, each request's time in the engine recorded as it ends."""
        async for out in outputs:
            if getattr(out, "timing", None) is not None:
                self.metrics.timing(out.timing)
            yield out

    async def subscribe(self, sub: Subscription) -> AsyncIterator[str | list[RequestOutput]]:
        """A router's output subscription to this replica (streaming/output_channels.py)."""
        if self.role == "prefill":
            raise ValueError("a prefill replica streams no outputs to routers")
        async for item in self.channels.subscribe(sub):
            yield item

    async def prefill(
        self,
        request: EngineRequest,
        skip_blocks: int,
        dst_tp: int | None = None,
        transport: str | None = None,
    ) -> PrefillResult:
        """Prefills the prompt and returns the first token with the blocks from
        `skip_blocks` on, cut for a decode replica of TP degree `dst_tp` (each of its
        ranks then fetches only its KV heads), exported by `transport` (None: the
        pool's); the blocks are released here once copied out."""
        if self.role != "prefill":
            raise ValueError(f"a {self.role} replica does not run prefill()")
        rid = request.request_id
        start = time.perf_counter()
        final = None
        stream = self.engine.generate(
            rid, list(request.prompt_token_ids), request.params, request.cache_salt, True
        )
        async for out in stream:
            final = out
        assert final is not None and final.finished
        prefill_s = time.perf_counter() - start
        if final.timing is not None:
            self.metrics.timing(final.timing)
        if final.finish_reason is FinishReason.ABORT:
            # This replica is shutting down: a failure for decode to recover from (it
            # recomputes the prompt), not a request that ended at its first token.
            raise EngineDeadError(f"the prefill replica aborted {rid}: it is stopping")
        if final.handoff is None:  # the first token ended the request: nothing to hand off
            return PrefillResult(final, None, [], prefill_s)
        released = False
        try:
            # One engine command, so the blocks are released even if this task is
            # cancelled while it waits for the copy.
            handle, parts = await self.engine.export_kv(
                rid, skip_blocks, dst_tp, transport, release=True
            )
            released = True
        finally:
            if not released:
                self.engine.abort_nowait(rid)
        final.handoff = None  # the handle travels on its own field
        return PrefillResult(final, handle, parts, prefill_s)

    # -- Serve hooks and status --------------------------------------------------

    def record_routing_stats(self) -> dict[str, float]:
        # Serve calls this about once a second: the moment to post status and metrics too.
        if not self.engine.is_healthy():
            # Every call here now fails at once, so this replica would look the least
            # loaded and its registry entries would keep drawing prompts: the request
            # router skips it from now on, until Serve's health check replaces it.
            if not self._withdrawn:
                self._withdrawn = True
                self.registry.remove_replica.remote(self.replica_id)
                logger.error("%s replica %s: engine failed; withdrawn", self.role, self.replica_id)
            return {"healthy": 0.0}
        s = self.engine.stats()
        if time.monotonic() - self._last_heartbeat >= HEARTBEAT_S:
            # Keeps this replica's entries in the registry while its cache is quiet.
            self._last_heartbeat = time.monotonic()
            self._publish([], [])
        if self.gpus.transient or self.gpus.available:  # no driver or GPU stays so
            self.gpus = read_gpus(self._visible_gpus)
            self.metrics.gpus(self.gpus)
        self.metrics.engine(s)
        if self.decode is not None:
            self.decode.check_prefill_pool()  # degraded mode shows while no request comes
        self._replace_lost_actors()
        self._last_post = self.board.post.remote(self.replica_id, self.stats()).future()
        return {
            "num_ongoing": s.num_running + s.num_waiting + s.imports_waiting,
            "kv_free_fraction": s.num_free_blocks / max(s.num_total_blocks, 1),
            "healthy": 1.0,
        }

    def _replace_lost_actors(self) -> None:
        """The registry and the status board are advisory actors: when one is gone (its
        node died, or it was killed), this replica starts a new one and talks to that.
        A registry that forgot this replica (restarted empty by Ray, or it heard nothing
        from it for its TTL) says so with a new session: then, as for a new registry,
        it hears every block this replica caches with its next engine step (an idle
        replica's, once traffic comes back)."""
        if _actor_lost(self._last_publish):
            logger.warning("the prefix registry is gone; starting a new one")
            self._last_publish = None
            self.registry = get_or_create_registry(self.registry_config)
            self.engine.resend_cached_blocks()
        session = _answer(self._last_publish)
        if session is not None and session != self._registry_session:
            if self._registry_session is not None:
                logger.warning("the prefix registry forgot this replica; resending its cache")
            self._registry_session = session
            self.engine.resend_cached_blocks()
        if _actor_lost(self._last_post):
            logger.warning("the status board is gone; starting a new one")
            self._last_post = None
            self.board = get_or_create_board(self.board_name)

    def check_health(self) -> None:
        if not self.engine.is_healthy():
            raise RuntimeError(f"{self.role} replica {self.replica_id}: its engine has failed")

    def stats(self) -> dict:
        """This replica's dtype, TP degree, activation rounding, engine stats and handoff
        totals, for `baton status` and tests."""
        return {
            "app": self.app_name,
            "role": self.role,
            "replica_id": self.replica_id,
            **self.engine_setup,
            "engine": asdict(self.engine.stats()),
            # A decode replica's handoffs (all zeros elsewhere) and prefill calls in flight.
            "handoff": asdict(self.decode.stats if self.decode else HandoffStats()),
            "pending_prefills": self.decode.selective.num_pending_prefills if self.decode else 0,
            "mux": self.channels.stats(),
            "gpus": self.gpus.to_dict(),
        }

    async def live_kv_exports(self) -> tuple[int, int]:
        """(objects, bytes) of KV this replica's ranks exported that a decode replica still
        references: a handoff's export lives until its import, then Ray frees it."""
        return await asyncio.to_thread(self.engine.live_kv_exports)

    async def __del__(self) -> None:
        # Serve calls this on graceful shutdown (scale down, redeploy), and also after a
        # constructor that failed part way: only undo what was done.
        if hasattr(self, "channel_server"):
            self.channel_server.close()
        if hasattr(self, "engine"):
            try:
                await self.engine.shutdown()
            finally:
                # After the engine's last step, whose batch would add it back.
                self.registry.remove_replica.remote(self.replica_id)
                self.board.remove.remote(self.replica_id)


def _answer(call: Future | None):
    """A finished fire-and-forget call's result; None while it runs or if it failed."""
    if call is None or not call.done() or call.exception() is not None:
        return None
    return call.result()


def _actor_lost(call: Future | None) -> bool:
    """Whether a finished fire-and-forget call failed because its actor is gone."""
    return call is not None and call.done() and isinstance(call.exception(), RayActorError)
