"""A full service, live on Ray Serve: past what its pool runs and queues, a request is
refused at once as RESOURCE_EXHAUSTED (gRPC) or 503 with Retry-After (HTTP), the
requests already admitted go on to their end, and the next request is served."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from email.message import Message

import grpc
import pytest
from ray import serve
from service_helpers import KV, _snapshots, wait_for

from serve_app.config import AppConfig, PoolConfig
from serve_app.ops import service_ops
from serve_app.ops.client import BatonClient, generate_request

pytestmark = pytest.mark.slow

APP = "small"
LONG = 160  # tokens: a stream that runs for seconds on this machine


@pytest.fixture(scope="module")
def small(ray_cluster, smollm2_dir, serve_ports):
    # One request at a time per replica (the router's output subscription, a socket,
    # takes no slot), one more queued at the router: the third concurrent request finds
    # the service full.
    pool = PoolConfig(kv_cache_bytes=KV, max_ongoing_requests=1, max_queued_requests=1)
    config = AppConfig(mode="aggregated", aggregated=pool)
    service_ops.deploy(config, app_name=APP, route_prefix=f"/{APP}", **serve_ports)
    yield {
        "grpc": f"127.0.0.1:{serve_ports['grpc_port']}",
        "http": f"http://127.0.0.1:{serve_ports['http_port']}/{APP}",
    }
    serve.shutdown()


def _stats() -> dict:
    # From the status board: a call to a full replica would wait for a slot itself. The
    # replica posts with Serve's routing-stats calls, which a busy 2-core machine can
    # leave a post older than the board keeps for a moment: wait for a fresh one.
    def fresh() -> dict | None:
        return next((s for s in _snapshots() if s["app"] == APP), None)

    return wait_for(fresh, f"a status post of {APP!r}", timeout_s=60.0)


def _long(prompt: str):
    return generate_request(prompt, max_tokens=LONG, temperature=0.0, ignore_eos=True)


def _stream_to_end(address: str, prompt: str) -> int | tuple[grpc.StatusCode, str]:
    """The stream's completion tokens, or the status code it failed with."""
    with BatonClient(address, application=APP) as client:
        try:
            return sum(len(m.token_ids) for m in client.generate(_long(prompt)))
        except grpc.RpcError as e:
            return e.code(), e.details()


def test_a_full_service_refuses_at_once_and_serves_what_it_admitted(small):
    first_token = threading.Event()

    def running() -> int:
        with BatonClient(small["grpc"], application=APP) as client:
            total = 0
            for msg in client.generate(_long("Tell me about rivers.")):
                total += len(msg.token_ids)
                first_token.set()
            return total

    with ThreadPoolExecutor(8) as pool:
        admitted = pool.submit(running)
        assert first_token.wait(120), "the first stream did not start"
        # The later requests are muxed on the router's output subscription.
        wait_for(lambda: _stats()["mux"]["open_subscriptions"] == 1, "the subscription")
        others = [
            pool.submit(_stream_to_end, small["grpc"], f"Tell me about comet {i}.")
            for i in range(4)
        ]
        results = [f.result(timeout=300) for f in others]
        assert admitted.result(timeout=300) == LONG

    refused = [r[1] for r in results if isinstance(r, tuple)]
    assert {r[0] for r in results if isinstance(r, tuple)} <= {grpc.StatusCode.RESOURCE_EXHAUSTED}
    served = [r for r in results if r == LONG]
    # One waits in the router's queue and is served after the first; the rest are refused.
    assert (len(refused), len(served)) == (3, 1), results
    # Each refusal says why in one line, with no traceback.
    assert all(d and "\n" not in d and "Traceback" not in d for d in refused), refused
    with BatonClient(small["grpc"], application=APP) as client:
        reply = client.generate_unary(generate_request("Hi", max_tokens=2, temperature=0.0))
    assert reply.usage.completion_tokens == 2
    engine = _stats()["engine"]
    wait_for(
        lambda: (e := _stats()["engine"])["num_free_blocks"] == e["num_total_blocks"],
        f"every block to be free (now {engine['num_free_blocks']} of {engine['num_total_blocks']})",
        timeout_s=30,
    )


def test_http_clients_get_503_with_retry_after_when_it_is_full(small):
    first_token = threading.Event()
    body = {"prompt": "Tell me about lakes.", "max_tokens": LONG, "ignore_eos": True}

    def post(data: dict) -> tuple[int, Message, dict]:
        request = urllib.request.Request(
            f"{small['http']}/v1/completions",
            json.dumps(data).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                return response.status, response.headers, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, e.headers, json.loads(e.read())

    def running() -> int:
        with BatonClient(small["grpc"], application=APP) as client:
            total = 0
            for msg in client.generate(_long("Tell me about seas.")):
                total += len(msg.token_ids)
                first_token.set()
        return total

    with urllib.request.urlopen(f"{small['http']}/v1/models", timeout=30) as models:
        (served,) = json.loads(models.read())["data"]
    body["model"] = served["id"]
    with ThreadPoolExecutor(8) as pool:
        admitted = pool.submit(running)
        assert first_token.wait(120), "the first stream did not start"
        wait_for(lambda: _stats()["mux"]["open_subscriptions"] == 1, "the subscription")
        results = list(pool.map(post, [body] * 4))
        assert admitted.result(timeout=300) == LONG
    full = [(headers, error) for status, headers, error in results if status == 503]
    assert len(full) == 3, [status for status, _, _ in results]
    # The one the router queued is served to its end.
    (ok,) = [reply for status, _, reply in results if status != 503]
    assert ok["usage"]["completion_tokens"] == LONG, ok
    for headers, error in full:
        assert headers.get("Retry-After") == "1"
        assert "capacity" in error["error"]["message"]
