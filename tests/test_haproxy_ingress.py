"""The ingress (Serve's HAProxy under Baton's policy, serve_app/ingress/) in front of two
router replicas of an aggregated application: oversized metadata, slow headers and
bodies, and a router's kill -9. Real Ray, Serve and HAProxy, the real SmolLM2."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import ray
from service_helpers import KV, wait_for

from serve_app.config import AppConfig, PoolConfig, RouterConfig
from serve_app.grpc.api import baton_pb2_grpc as pb_grpc
from serve_app.ingress import IngressPolicy
from serve_app.ops import service_ops
from serve_app.ops.client import generate_request

pytestmark = pytest.mark.slow

APP = "ingress"
POLICY = IngressPolicy()  # the launcher's: the tests set no BATON_INGRESS_* variable


def _router_pids() -> list[int]:
    prefix = f"SERVE_REPLICA::{APP}#Router#"
    return [
        a["Pid"]
        for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and a["Name"].startswith(prefix)
    ]


@pytest.fixture(scope="module")
def ingress(ray_cluster, smollm2_dir, serve_ports):
    config = AppConfig(
        model=str(smollm2_dir),
        mode="aggregated",
        aggregated=PoolConfig(kv_cache_bytes=KV),
        router=RouterConfig(num_replicas=2, num_cpus=0),
        status_board_name="baton-status-ingress",
    )
    service_ops.deploy(config, app_name=APP, route_prefix=f"/{APP}", **serve_ports)
    wait_for(lambda: len(_router_pids()) == 2, "both routers")
    try:
        yield {
            "http": f"http://127.0.0.1:{serve_ports['http_port']}",
            "http_port": serve_ports["http_port"],
            "grpc": f"127.0.0.1:{serve_ports['grpc_port']}",
        }
    finally:
        service_ops.stop(APP)  # Serve too, and the ports it recorded for the next module


def _metadata():
    return (("application", APP),)


def test_serves_haproxy_runs_the_policy_config(ingress):
    configs = [
        args[args.index("-f") + 1]
        for args in map(_cmdline, (int(p) for p in os.listdir("/proc") if p.isdigit()))
        if args and args[0].endswith("/haproxy") and "-f" in args
    ]
    assert configs and all(c.endswith("haproxy.cfg.baton") for c in configs), configs
    with open(configs[-1]) as f:
        text = f.read()
    assert f"timeout http-request {POLICY.header_timeout_s}s" in text
    assert "bind 127.0.0.1:8404" in text and "500.http" not in text


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def test_a_call_with_oversized_metadata_fails_alone(ingress):
    with grpc.insecure_channel(ingress["grpc"]) as channel:
        stub = pb_grpc.BatonStub(channel)
        request = generate_request("Once upon a time", max_tokens=40, temperature=0.0)
        stream = stub.Generate(request, metadata=_metadata(), timeout=120)
        first = next(stream)  # a stream in flight on the same connection
        big = (*_metadata(), ("x-note", "a" * 20_000))
        with pytest.raises(grpc.RpcError) as refused:
            stub.GenerateUnary(request, metadata=big, timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"exceed {POLICY.max_header_bytes} bytes" in refused.value.details()
        rest = list(stream)  # the other stream lives, and so does the connection
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 40
        assert stub.GenerateUnary(request, metadata=_metadata(), timeout=60).text
    request = urllib.request.Request(
        f"{ingress['http']}/{APP}/v1/models", headers={"x-note": "a" * 20_000}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request)
    assert refused.value.code == 431
    error = json.loads(refused.value.read())["error"]
    assert error["code"] == "request_header_fields_too_large"


def _closed_after(port: int, sent: bytes) -> tuple[float, bytes]:
    """Seconds until the ingress closes a connection that sent only `sent`, and what it
    answered."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(sent)
        started, answer = time.monotonic(), b""
        conn.settimeout(POLICY.header_timeout_s * 6)
        while chunk := conn.recv(4096):
            answer += chunk
        return time.monotonic() - started, answer


def test_slow_headers_and_a_slow_body_are_closed_within_the_timeout(ingress):
    path = f"/{APP}/v1/completions"
    partial_headers = f"POST {path} HTTP/1.1\r\nHost: baton\r\n".encode()
    partial_body = (
        f"POST {path} HTTP/1.1\r\nHost: baton\r\nContent-Type: application/json\r\n"
        'Content-Length: 1000\r\n\r\n{"model": '
    ).encode()
    for sent in (partial_headers, partial_body):
        waited, answer = _closed_after(ingress["http_port"], sent)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert POLICY.header_timeout_s - 1 <= waited <= POLICY.header_timeout_s + 5, waited


def test_killing_one_of_two_routers_costs_only_retryable_errors(ingress):
    completions = f"{ingress['http']}/{APP}/v1/completions"
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The sea", "max_tokens": 64}
    body |= {"temperature": 0.0, "ignore_eos": True}
    answers: list[tuple[int, dict, str | None]] = []

    def call() -> None:
        request = urllib.request.Request(
            completions, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                answers.append((response.status, json.loads(response.read()), None))
        except urllib.error.HTTPError as e:
            answers.append((e.code, json.loads(e.read()), e.headers.get("Retry-After")))

    grpc_codes: list[grpc.StatusCode] = []

    def grpc_call(stub) -> None:
        request = generate_request("The sea", max_tokens=64, temperature=0.0, ignore_eos=True)
        try:
            stub.GenerateUnary(request, metadata=_metadata(), timeout=120)
            grpc_codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            grpc_codes.append(e.code())

    with grpc.insecure_channel(ingress["grpc"]) as channel:
        stub = pb_grpc.BatonStub(channel)
        threads = [threading.Thread(target=call) for _ in range(6)]
        threads += [threading.Thread(target=grpc_call, args=(stub,)) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # every call is at a router, generating
        os.kill(_router_pids()[0], signal.SIGKILL)
        for t in threads:
            t.join(timeout=180)
    assert len(answers) == 6 and len(grpc_codes) == 6
    for status, answer, retry_after in answers:
        if status != 200:  # never a plain-text 500: a retryable 503 in OpenAI's shape
            assert status == 503 and retry_after is not None, (status, answer)
            assert answer["error"]["type"] == "service_unavailable_error"
    assert set(grpc_codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, grpc_codes
    lost = sum(s != 200 for s, _, _ in answers) + sum(c != grpc.StatusCode.OK for c in grpc_codes)
    assert lost, "no call was on the killed router"
    # The openai SDK's own retries (2 by default, honouring Retry-After) carry a request
    # through a router's death.
    client = openai.OpenAI(base_url=f"{ingress['http']}/{APP}/v1", api_key="unused")
    os.kill(_router_pids()[0], signal.SIGKILL)
    done = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The sea", max_tokens=8, temperature=0.0
    )
    assert done.choices[0].text
    wait_for(lambda: len(_router_pids()) == 2, "the routers replaced")
