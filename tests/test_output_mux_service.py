"""Multiplexed outputs (serve_app/streaming/output_channels.py) when an engine replica dies
under them, and the router's migration of its requests, against a real Serve on the real
model (the protocol itself: test_output_mux.py)."""

from __future__ import annotations

import os
import signal

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray import serve
from service_helpers import KV, wait_for

from serve_app.config import AppConfig, PoolConfig
from serve_app.ops import service_ops
from serve_app.ops.client import BatonClient, generate_request
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

APP = "dying"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MAX_NEW = 96


def _engine_stats() -> dict:
    return serve.get_deployment_handle("EngineServer", app_name=APP).stats.remote().result()


def _subscribed() -> int:
    return _engine_stats()["mux"]["open_subscriptions"]


def _answers(client: BatonClient) -> bool:
    try:
        reply = client.generate_unary(generate_request("Hello", max_tokens=2), timeout=30)
    except grpc.RpcError:
        return False
    return reply.usage.completion_tokens == 2


def test_streams_on_a_dying_replica_migrate_to_its_replacement_and_lose_nothing(
    ray_cluster, smollm2_dir, serve_ports
):
    """kill -9 of the only engine replica's process while 3 greedy streams and a seeded
    sampled one decode on it: each goes on, once Serve has a replacement, with the text it
    would have had undisturbed (router.py's migration), and usage counts it once."""
    config = AppConfig(
        model=str(smollm2_dir),
        mode="aggregated",
        aggregated=PoolConfig(kv_cache_bytes=KV),
        status_board_name="baton-status-dying",
    )
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), kv_cache_bytes=KV))
    kinds = [{"temperature": 0.0}] * 3 + [{"temperature": 0.8, "seed": 11}]
    texts = [f"Story {i}: once upon a time" for i in range(4)]
    expected = [
        engine.generate(
            [engine.tokenizer.encode(t)],
            SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, **kind),
        )[0].output_token_ids
        for t, kind in zip(texts, kinds, strict=True)
    ]
    service_ops.deploy(config, app_name=APP, route_prefix=f"/{APP}", **serve_ports)
    try:
        with BatonClient(f"127.0.0.1:{serve_ports['grpc_port']}", application=APP) as client:
            # The first request streams on its call; the router then subscribes.
            assert _answers(client)
            wait_for(_subscribed, "a subscription", poll_s=0.2)
            streams = [
                client.generate(
                    generate_request(t, max_tokens=MAX_NEW, ignore_eos=True, **kind), timeout=180
                )
                for t, kind in zip(texts, kinds, strict=True)
            ]
            firsts = [next(stream) for stream in streams]  # each is decoding
            assert all(f.token_ids for f in firsts)
            (pid,) = [
                a["Pid"]
                for a in ray._private.state.actors().values()  # the GCS's actor table
                if a["State"] == "ALIVE"
                and a["Name"].startswith(f"SERVE_REPLICA::{APP}#EngineServer")
            ]
            os.kill(pid, signal.SIGKILL)
            # While the pool has no replica, health checks say so (for load balancers).
            health = health_pb2_grpc.HealthStub(client.channel)

            def status() -> int:
                check = health_pb2.HealthCheckRequest(service="baton.v1.Baton")
                return health.Check(check, metadata=client.metadata, timeout=10).status

            wait_for(lambda: status() == NOT_SERVING, "NOT_SERVING", timeout_s=30, poll_s=0.2)

            for first, stream, want in zip(firsts, streams, expected, strict=True):
                rest = list(stream)
                got = list(first.token_ids) + [t for r in rest for t in r.token_ids]
                assert got == want
                assert rest[-1].usage.completion_tokens == MAX_NEW
            # Serve started a replacement; the router subscribed to it, and no block is held.
            wait_for(_subscribed, "a new subscription", poll_s=0.2)
            wait_for(lambda: status() == SERVING, "SERVING again", timeout_s=30, poll_s=0.2)
            wait_for(
                lambda: _engine_stats()["engine"]["num_running"] == 0, "the replica to go idle"
            )
            stats = _engine_stats()["engine"]
            assert stats["num_free_blocks"] == stats["num_total_blocks"] > 0
    finally:
        serve.delete(APP)
        serve.shutdown()


def test_the_client_that_opened_a_subscription_leaving_cuts_no_other_stream(
    ray_cluster, smollm2_dir, serve_ports
):
    """The subscription opens while its first request is served; Serve cancels that
    request's child calls when its client leaves, and the subscription must not be one.
    (Over Ray actor calls, where Serve 2.60 cancels every child; over its gRPC channel
    it stops at the first, which hides the same mistake.)"""
    app = "opener-leaves"
    config = AppConfig(
        model=str(smollm2_dir),
        mode="aggregated",
        output_channel="actor_call",
        aggregated=PoolConfig(kv_cache_bytes=KV),
        status_board_name="baton-status-opener",
    )
    service_ops.deploy(config, app_name=app, route_prefix=f"/{app}", **serve_ports)
    stats = serve.get_deployment_handle("EngineServer", app_name=app).stats
    try:
        with BatonClient(f"127.0.0.1:{serve_ports['grpc_port']}", application=app) as client:
            long = {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0}
            opener = client.generate(generate_request("Opener:", **long), timeout=120)
            assert next(opener).token_ids  # on its own call: the router now subscribes
            wait_for(lambda: stats.remote().result()["mux"]["open_subscriptions"], "a subscription")
            others = [
                client.generate(generate_request(f"Story {i}:", **long), timeout=120)
                for i in range(2)
            ]
            firsts = [len(next(stream).token_ids) for stream in others]
            assert all(firsts)
            assert stats.remote().result()["mux"]["num_muxed_requests"] == 2
            opener.cancel()
            for stream, first in zip(others, firsts, strict=True):
                # Every token arrives; a consumer that fell behind gets its backlog
                # merged, so messages may be fewer than tokens.
                assert first + sum(len(msg.token_ids) for msg in stream) == 200
    finally:
        serve.delete(app)
        serve.shutdown()
