"""The disaggregated application under load and faults, end to end: real Ray, Serve's
ingress, the real SmolLM2 model, prefill TP 3 -> decode TP 1 with KV over nixl (conftest's
"disagg"). Concurrent streams, transfers of only the blocks decode lacks, cancellation and
deadlines freeing blocks on both pools, bad input, a live resize of the prefill pool,
metrics, and losing the prefix registry. The last test checks that every request of the
module gave all its KV blocks back.

The service is conftest.py's module-scoped `service` fixture with "disagg" alone; the tests
run in file order and share it (test_service.py deploys its own, with "agg" beside it).
"""

from __future__ import annotations

import threading
import time

import grpc
import openai
import pytest
import ray
from service_helpers import (
    _cached_prompt_hashes,
    _decode_stats,
    _greedy,
    _holds,
    _registry,
    _scrape,
    _snapshots,
    _wait_idle,
    _wait_prefill_exports_freed,
    baton_without_torch,
    wait_for,
)

from serve_app.grpc.api import baton_pb2 as pb
from serve_app.ops.client import generate_request

pytestmark = pytest.mark.slow

SERVICE_APPS = ("disagg",)


def test_sixteen_concurrent_streams_all_complete(disagg):
    # One request first: the router then subscribes to the decode replica's outputs, and
    # the sixteen share that subscription (serve_app/streaming/output_channels.py).
    disagg.generate_unary(_greedy("Warm up", max_tokens=2))
    deadline = time.monotonic() + 10
    while not _decode_stats()["mux"]["open_subscriptions"]:
        assert time.monotonic() < deadline, "the router did not subscribe to decode's outputs"
        time.sleep(0.05)
    before = _decode_stats()["mux"]
    results: dict[int, list] = {}

    def run(i: int) -> None:
        request = generate_request(
            f"Story number {i}: once upon a time", max_tokens=16, temperature=0.8, seed=i
        )
        results[i] = list(disagg.generate(request, timeout=300))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(16))
    for messages in results.values():
        assert messages[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert sum(len(m.token_ids) for m in messages) == messages[-1].usage.completion_tokens
    after = _decode_stats()["mux"]
    assert after["num_muxed_requests"] - before["num_muxed_requests"] == 16
    sent = {k: after[k] - before[k] for k in ("num_outputs", "num_batches")}
    assert sent["num_outputs"] > sent["num_batches"]  # several streams' tokens per message


def test_a_prefix_decode_holds_is_not_transferred_again(disagg):
    prompt = "Here is a long shared system preamble for every request. " * 8
    num_tokens = len(disagg.tokenize(prompt))
    full_blocks = num_tokens // 16
    assert full_blocks >= 4
    before = _decode_stats()["handoff"]
    disagg.generate_unary(_greedy(prompt, max_tokens=4))
    middle = _decode_stats()["handoff"]
    disagg.generate_unary(_greedy(prompt, max_tokens=4))
    after = _decode_stats()["handoff"]
    cold = middle["blocks_received"] - before["blocks_received"]
    warm = after["blocks_received"] - middle["blocks_received"]
    assert cold == -(-num_tokens // 16)  # every block of the prompt, partial one included
    assert warm == cold - full_blocks  # decode's own prefix cache covered the full blocks
    assert after["num_bytes"] - middle["num_bytes"] < middle["num_bytes"] - before["num_bytes"]
    # A prompt of whole blocks, every one already held by decode: an empty handoff.
    whole_blocks = disagg.tokenize(prompt)[: 2 * 16]
    assert disagg.generate_unary(_greedy(whole_blocks, max_tokens=4)).usage.completion_tokens
    empty = _decode_stats()["handoff"]
    assert empty["blocks_received"] == after["blocks_received"]
    # A handoff all the same (its first token came from prefill), not a recompute.
    assert empty["num_handoffs"] == after["num_handoffs"] + 1
    assert empty["num_recomputed_tokens"] == after["num_recomputed_tokens"]


def _decode_tokens() -> int:
    return _decode_stats()["engine"]["num_generated_tokens"]


def test_a_grpc_stream_cancelled_mid_stream_stops_generating_and_frees_its_blocks(disagg):
    _wait_idle()
    before = _decode_tokens()
    stream = disagg.generate(_greedy("Count to a thousand:", max_tokens=400, ignore_eos=True))
    for _, _ in zip(range(3), stream, strict=False):
        pass
    stream.cancel()
    _wait_idle()
    # Cancelled, not run to max_tokens: the cancel reached the decode engine.
    assert _decode_tokens() - before < 400


def test_exports_free_at_import_and_cancels_and_deadlines_free_the_blocks(service, disagg):
    _wait_idle()
    before = _decode_tokens()
    # Mid-stream, over HTTP: the openai client closes its SSE stream.
    client = openai.OpenAI(base_url=f"{service['http']}/disagg/v1", api_key="unused")
    (model,) = [m.id for m in client.models.list()]
    stream = client.completions.create(
        model=model,
        prompt="Count to a thousand:",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},  # still running while the export is checked
    )
    for _, _ in zip(range(3), stream, strict=False):
        pass
    # Imported, so the prefill ranks have freed the export though the request goes on.
    _wait_prefill_exports_freed()
    stream.close()
    _wait_idle()
    assert _decode_tokens() - before < 400  # the close reached the decode engine
    before = _decode_tokens()
    with pytest.raises(grpc.RpcError) as err:
        long = _greedy("Tell me a long story.", max_tokens=400, ignore_eos=True)
        disagg.generate_unary(long, timeout=1.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle()
    assert _decode_tokens() - before < 400  # so did the deadline


BAD_GRPC = [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 99}, "logprobs"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"stop": [""]}, "stop"),
]


@pytest.mark.parametrize(("fields", "named"), BAD_GRPC)
def test_bad_grpc_input_is_invalid_argument_naming_the_field(disagg, fields, named):
    with pytest.raises(grpc.RpcError) as err:
        disagg.generate_unary(generate_request("Hello", **fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in err.value.details() and "Traceback" not in err.value.details()
    assert disagg.generate_unary(_greedy("Hello", max_tokens=2)).usage.completion_tokens == 2


def test_bad_grpc_prompts(disagg):
    for request in (pb.GenerateRequest(), generate_request([49152]), generate_request([])):
        with pytest.raises(grpc.RpcError) as err:
            disagg.generate_unary(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in err.value.details()
    # Bytes that are no GenerateRequest (invalid UTF-8 in its text), streamed or not.
    for method, call in (("GenerateUnary", "unary_unary"), ("Generate", "unary_stream")):
        send = getattr(disagg.channel, call)(f"/baton.v1.Baton/{method}")
        with pytest.raises(grpc.RpcError) as err:
            reply = send(b"\x12\x02\xff\xfe", metadata=disagg.metadata, timeout=30)
            list(reply)  # a unary call raised above already
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "not a valid baton.v1.GenerateRequest" in err.value.details()
    assert disagg.generate_unary(_greedy("Hello", max_tokens=2)).usage.completion_tokens == 2


def test_scaling_prefill_during_traffic_fails_nothing_and_the_new_replica_serves(disagg):
    errors: list[BaseException] = []
    done = threading.Event()

    def traffic(i: int) -> None:
        n = 0
        while not done.is_set():
            try:
                out = disagg.generate_unary(
                    generate_request(f"Request {i}.{n}: say something", max_tokens=6, seed=n),
                    timeout=120,
                )
                assert out.usage.completion_tokens >= 1
            except BaseException as e:  # noqa: BLE001 - every failure is the finding
                errors.append(e)
            n += 1

    threads = [threading.Thread(target=traffic, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()

    def prefill_replicas() -> list[dict]:
        return [s for s in _snapshots() if (s["app"], s["role"]) == ("disagg", "prefill")]

    try:
        # As an operator's machine without the engine would: no torch in the driver.
        scaled = baton_without_torch("scale", "prefill", "2", "--app", "disagg")
        assert scaled.returncode == 0, scaled.stderr
        assert "prefill pool scaled to 2 replicas" in scaled.stderr
        # Traffic goes on until both replicas have computed some of it.
        wait_for(
            lambda: [s["engine"]["num_steps"] > 0 for s in prefill_replicas()] == [True] * 2,
            "the new prefill replica to serve",
            timeout_s=60,
        )
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert len(prefill_replicas()) == 2


def test_metrics_reach_rays_prometheus_endpoint(disagg, ray_metrics_port):
    disagg.generate_unary(_greedy("Metrics, please.", max_tokens=4))
    with pytest.raises(grpc.RpcError) as err:  # counted as invalid
        disagg.generate_unary(generate_request("Metrics, please.", temperature=-1.0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # vLLM's names (as Ray Serve LLM exports them) and Baton's own; all the dashboard's
    # (test_dashboard.py) that this module's traffic produces.
    wanted = {
        "ray_vllm_time_to_first_token_seconds_count",
        "ray_vllm_inter_token_latency_seconds_count",
        "ray_vllm_e2e_request_latency_seconds_count",
        "ray_vllm_request_prompt_tokens_count",
        "ray_vllm_request_generation_tokens_count",
        "ray_vllm_request_success_total",
        "ray_vllm_prompt_tokens_total",
        "ray_vllm_generation_tokens_total",
        "ray_baton_requests_total",
        "ray_vllm_num_requests_running",
        "ray_vllm_num_requests_waiting",
        "ray_vllm_kv_cache_usage_perc",
        "ray_vllm_prefix_cache_queries_total",
        "ray_vllm_request_queue_time_seconds_count",
        "ray_vllm_request_prefill_time_seconds_count",
        "ray_vllm_request_decode_time_seconds_count",
        "ray_baton_kv_handoff_bytes_total",
        "ray_baton_kv_handoff_seconds_count",
        "ray_baton_speculative_acceptance_ratio",  # the decode pool speculates (conftest)
    }
    samples: dict = {}

    def total(name: str, label: str = "") -> float:
        # This app's series only: earlier modules' apps record the same names in this Ray.
        ours = [(labels, v) for labels, v in samples.get(name, []) if 'app="disagg"' in labels]
        return sum(v for labels, v in ours if label in labels)

    def exported() -> bool:  # this test's own requests, whatever ran before it
        return (
            wanted <= set(samples)
            and total("ray_baton_requests_total", 'status="ok"') >= 1
            and total("ray_baton_requests_total", 'status="invalid"') >= 1
        )

    deadline = time.monotonic() + 60  # Ray exports on an interval
    while not exported():
        assert time.monotonic() < deadline, f"missing: {sorted(wanted - set(samples))}"
        time.sleep(2)
        samples = _scrape(ray_metrics_port)
    assert total("ray_vllm_time_to_first_token_seconds_count") >= 1
    assert total("ray_baton_kv_handoff_bytes_total") > 0
    # Every handoff of this module succeeded: nothing was silently recomputed.
    recomputed = total("ray_baton_handoff_recomputed_prompt_tokens_total")
    assert recomputed == 0, _decode_stats()["handoff"]["last_failure"]
    for name in ("ray_vllm_kv_cache_usage_perc", "ray_baton_speculative_acceptance_ratio"):
        assert all(0.0 <= v <= 1.0 for _, v in samples[name]), samples[name]
    running = samples["ray_vllm_num_requests_running"]
    assert any('pool="decode"' in labels for labels, _ in running)
    # Every series carries the served model's name, as vLLM's dashboards filter by it.
    for name in wanted:
        ours = [labels for labels, _ in samples[name] if 'app="disagg"' in labels]
        assert ours and all('model_name="SmolLM2-135M-Instruct"' in la for la in ours), name


def _wait_until_told_again(disagg, hashes, prompt: str) -> None:
    """Until the registry (a new or restarted one) holds `hashes` again: replicas resend
    their cache with an engine step, so they are given steps to take."""
    deadline = time.monotonic() + 30
    while True:
        registry = _registry()
        try:
            if _holds(registry, hashes):
                return
        except ray.exceptions.ActorUnavailableError:  # while Ray restarts it
            pass
        assert time.monotonic() < deadline, "the registry never heard of the earlier prompt"
        disagg.generate_unary(_greedy(f"{prompt} Again at {time.monotonic()}.", max_tokens=2))
        time.sleep(1)


def test_losing_the_prefix_registry_costs_routing_hints_not_requests(disagg, smollm2_dir):
    earlier = "A prompt the replicas cache before their prefix registry is lost. " * 4
    hashes = _cached_prompt_hashes(disagg, smollm2_dir, earlier)
    ray.kill(_registry())
    prompt = "A prompt long enough to be hashed and looked up in the registry. " * 4
    assert disagg.generate_unary(_greedy(prompt, max_tokens=4)).usage.completion_tokens == 4
    # The router started a new registry; the replicas, finding theirs gone, publish to it
    # all they hold, the prompt cached before the loss among it.
    _wait_until_told_again(disagg, hashes, prompt)


def test_a_registry_restarted_empty_hears_every_replicas_cache_again(disagg, smollm2_dir):
    """Ray restarts the registry (its node went): calls to it go on succeeding, and the
    replicas learn it forgot them from the new session their next publish returns."""
    earlier = "A prompt the replicas cache before their prefix registry restarts. " * 4
    hashes = _cached_prompt_hashes(disagg, smollm2_dir, earlier)
    ray.kill(_registry(), no_restart=False)
    _wait_until_told_again(disagg, hashes, "Another prompt, to give the replicas steps. " * 4)


def test_every_pool_gets_all_its_blocks_back(service):
    """Last: after every request of the module, cancelled and refused ones too."""
    snaps = _wait_idle()
    assert {(s["role"], s["tensor_parallel_size"]) for s in snaps} == {
        ("prefill", 3),
        ("decode", 1),
    }
