"""A service deployed with API keys (AppConfig.api_key_file), live on Ray Serve: gRPC and
OpenAI HTTP calls without one of its keys are refused as unauthenticated, health checks
stay open, the service goes on serving callers that hold a key, and a rewritten key
file takes effect without a restart."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from conftest import METRICS_EXPORT_S
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from ray import serve
from service_helpers import KV, _scrape

from serve_app.config import AppConfig, PoolConfig
from serve_app.grpc.api import baton_pb2 as pb
from serve_app.ops import service_ops
from serve_app.ops.client import BatonClient, generate_request

pytestmark = pytest.mark.slow

APP = "keyed"


KEYS = ("first-test-key", "second-test-key")


@pytest.fixture(scope="module")
def keyed(ray_cluster, smollm2_dir, serve_ports, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys"  # the router runs on this machine
    key_file.write_text("\n".join(KEYS) + "\n")
    config = AppConfig(
        mode="aggregated", api_key_file=str(key_file), aggregated=PoolConfig(kv_cache_bytes=KV)
    )
    service_ops.deploy(config, app_name=APP, route_prefix=f"/{APP}", **serve_ports)
    yield {
        "grpc": f"127.0.0.1:{serve_ports['grpc_port']}",
        "http": f"http://127.0.0.1:{serve_ports['http_port']}/{APP}",
        "file": key_file,
    }
    serve.shutdown()


def _hello() -> pb.GenerateRequest:
    return generate_request("Hello", max_tokens=3, temperature=0.0)


@pytest.mark.parametrize(("key", "message"), [(None, "missing API key"), ("wrong", "invalid")])
def test_grpc_calls_without_a_key_are_unauthenticated(keyed, key, message):
    with BatonClient(keyed["grpc"], application=APP, api_key=key) as client:
        calls = [
            lambda: list(client.generate(_hello())),
            lambda: client.generate_unary(_hello()),
            lambda: client.tokenize("Hello"),
            client.model_info,
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert message in caught.value.details()


def test_grpc_callers_with_either_key_are_served_and_health_needs_none(keyed):
    for key in KEYS:
        with BatonClient(keyed["grpc"], application=APP, api_key=key) as client:
            assert client.generate_unary(_hello()).usage.completion_tokens == 3
            assert client.tokenize("Hello")
    with grpc.insecure_channel(keyed["grpc"]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="baton.v1.Baton"),
            metadata=(("application", APP),),
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_health_watch_holds_a_request_slot_so_it_needs_a_key(keyed):
    request = health_pb2.HealthCheckRequest(service="baton.v1.Baton")
    with grpc.insecure_channel(keyed["grpc"]) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch
        with pytest.raises(grpc.RpcError) as caught:
            next(watch(request, metadata=(("application", APP),), timeout=30))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        meta = (("application", APP), ("authorization", f"Bearer {KEYS[1]}"))
        stream = watch(request, metadata=meta, timeout=30)
        assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
        stream.cancel()


def test_openai_clients_need_a_key(keyed):
    wrong = openai.OpenAI(base_url=f"{keyed['http']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        wrong.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    client = openai.OpenAI(base_url=f"{keyed['http']}/v1", api_key=KEYS[0])
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        temperature=0.0,
    )
    assert reply.usage.completion_tokens == 2


def test_plain_http_without_a_key_is_a_401_asking_for_bearer(keyed):
    request = urllib.request.Request(
        f"{keyed['http']}/v1/completions",
        data=json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "Hi"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 401
    assert caught.value.headers["WWW-Authenticate"] == "Bearer"
    assert "missing API key" in json.loads(caught.value.read())["error"]["message"]
    with urllib.request.urlopen(f"{keyed['http']}/health", timeout=30) as health:
        assert json.loads(health.read())["status"] == "ok"


def test_a_rewritten_key_file_rotates_the_keys_live(keyed):
    keyed["file"].write_text("rotated-key\n")
    try:
        with BatonClient(keyed["grpc"], application=APP, api_key="rotated-key") as client:
            assert client.tokenize("Hello")
        with (
            BatonClient(keyed["grpc"], application=APP, api_key=KEYS[0]) as client,
            pytest.raises(grpc.RpcError) as caught,
        ):
            client.tokenize("Hello")
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:  # the other tests' keys, whatever order they run in
        keyed["file"].write_text("\n".join(KEYS) + "\n")


def test_the_router_counts_client_requests_not_choices(keyed, ray_metrics_port):
    """Counts what this test sends: metrics are cumulative across the module and
    exported on an interval, so the figures are differences once the totals settle."""
    app = f'app="{APP}"'
    series = [
        ("ray_baton_requests_total", 'api="grpc"', 'status="unauthenticated"'),
        ("ray_baton_requests_total", 'api="http"', 'status="unauthenticated"'),
        ("ray_baton_requests_total", 'api="http"', 'status="ok"'),
        ("ray_vllm_generation_tokens_total", 'api="http"', ""),
    ]

    def totals() -> dict:
        samples = _scrape(ray_metrics_port)
        return {
            (name, api, status): sum(
                v
                for labels, v in samples.get(name, [])
                if app in labels and api in labels and status in labels
            )
            for name, api, status in series
        }

    # Settled: the same over two scrapes an export interval and more apart (the other
    # tests' requests may still be on their way).
    before, deadline = totals(), time.monotonic() + 60
    while True:
        time.sleep(METRICS_EXPORT_S + 1)
        if (now := totals()) == before:
            break
        assert time.monotonic() < deadline, "the metrics never settled"
        before = now
    client = openai.OpenAI(base_url=f"{keyed['http']}/v1", api_key=KEYS[0])
    three = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Hi",
        max_tokens=4,
        n=3,
        extra_body={"ignore_eos": True},
    )
    assert three.usage.completion_tokens == 12
    wrong = openai.OpenAI(base_url=f"{keyed['http']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=1)
    with (
        BatonClient(keyed["grpc"], application=APP) as anonymous,
        pytest.raises(grpc.RpcError),
    ):
        anonymous.generate_unary(generate_request("Hi", max_tokens=1))
    added = {
        # The n=3 completion once, with every choice's tokens.
        series[2]: 1,
        series[3]: 12,
        # The wrong key's completion and the keyless gRPC call.
        series[1]: 1,
        series[0]: 1,
    }
    expected = {k: before[k] + added[k] for k in series}
    deadline = time.monotonic() + 60  # Ray exports on an interval
    while (found := totals()) != expected:
        assert time.monotonic() < deadline, (found, expected)
        time.sleep(2)


def test_a_generic_client_needs_neither_key_nor_metadata_for_health_and_reflection(keyed):
    # grpcurl's defaults: one application behind the ingress takes every call.
    with grpc.insecure_channel(keyed["grpc"]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="baton.v1.Baton")
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        (listed,) = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([ask])
        )
    names = {s.name for s in listed.list_services_response.service}
    assert {"baton.v1.Baton", "grpc.health.v1.Health"} <= names
