"""Multiplexed outputs (serve_app/streaming/output_channels.py) when an engine replica dies
under them, against a real Serve on the real model (the protocol itself: test_output_mux.py)."""

from __future__ import annotations

import grpc
import pytest
import ray
from ray import serve
from service_helpers import KV, wait_for

from serve_app.config import AppConfig, PoolConfig
from serve_app.ops import service_ops
from serve_app.ops.client import BatonClient, generate_request

pytestmark = pytest.mark.slow

APP = "dying"


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


def test_a_dying_engine_replica_fails_its_muxed_streams_as_unavailable_and_is_replaced(
    ray_cluster, smollm2_dir, serve_ports
):
    config = AppConfig(
        model=str(smollm2_dir),
        mode="aggregated",
        aggregated=PoolConfig(kv_cache_bytes=KV),
        status_board_name="baton-status-dying",
    )
    service_ops.deploy(config, app_name=APP, route_prefix=f"/{APP}", **serve_ports)
    try:
        with BatonClient(f"127.0.0.1:{serve_ports['grpc_port']}", application=APP) as client:
            # The first request streams on its call; the router then subscribes.
            assert _answers(client)
            wait_for(_subscribed, "a subscription", poll_s=0.2)
            long = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}
            streams = [
                client.generate(generate_request(f"Story {i}:", **long), timeout=120)
                for i in range(3)
            ]
            for stream in streams:
                assert next(stream).token_ids  # each is decoding
            assert _engine_stats()["mux"]["num_muxed_requests"] == 3

            (name,) = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"SERVE_REPLICA::{APP}#EngineServer")
            ]
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

            for stream in streams:
                with pytest.raises(grpc.RpcError) as err:
                    for _ in stream:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
                assert "Traceback" not in err.value.details()
            # Serve starts a replacement; the router streams to it, and subscribes anew.
            wait_for(lambda: _answers(client), "the replacement replica to answer", poll_s=0.2)
            wait_for(_subscribed, "a new subscription", poll_s=0.2)
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
            for stream in others:
                assert next(stream).token_ids
            assert stats.remote().result()["mux"]["num_muxed_requests"] == 2
            opener.cancel()
            for stream in others:
                assert len([msg for msg in stream]) == 200 - 1
    finally:
        serve.delete(app)
        serve.shutdown()
