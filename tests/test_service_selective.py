"""Selective disaggregation (serve_app/engine_server.py): a decode replica prefills short
prompts, and prompts that arrive while it waits on the prefill pool, itself. Against a
real Serve on the real model: the output is the in-process engine's either way, the
counters say which path each prompt took, and no block is left held."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray import serve
from service_helpers import KV, _greedy, _scrape, wait_for

from serve_app.config import AppConfig, PoolConfig
from serve_app.ops import service_ops
from serve_app.ops.client import BatonClient
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

APP = "selective"
BOARD = "baton-status-selective"
LOCAL_TOKENS = 16
MAX_TOKENS = 16


def _stats(deployment: str) -> dict:
    return serve.get_deployment_handle(deployment, app_name=APP).stats.remote().result()


def _all_free() -> bool:
    engines = [_stats(d)["engine"] for d in ("PrefillServer", "DecodeServer")]
    return all(
        e["num_free_blocks"] == e["num_total_blocks"] and not e["num_running"] for e in engines
    )


@pytest.fixture(scope="module")
def client(ray_cluster, smollm2_dir, serve_ports):
    config = AppConfig(
        model=str(smollm2_dir),
        mode="disaggregated",
        local_prefill_tokens=LOCAL_TOKENS,
        max_pending_prefills=1,
        prefill=PoolConfig(kv_cache_bytes=KV),
        decode=PoolConfig(kv_cache_bytes=KV),
        status_board_name=BOARD,
    )
    service_ops.deploy(config, app_name=APP, route_prefix=f"/{APP}", **serve_ports)
    try:
        with BatonClient(f"127.0.0.1:{serve_ports['grpc_port']}", application=APP) as c:
            yield c
    finally:
        serve.delete(APP)
        serve.shutdown()


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return LLMEngine(EngineConfig(model=str(smollm2_dir), kv_cache_bytes=KV))


def _expected(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return [out.output_token_ids for out in engine.generate(prompts, params)]


def _long_prompt(engine: LLMEngine, topic: str) -> list[int]:
    # Long enough that its prefill (a few hundred ms here) is still pending when the
    # next request reaches decode; two of them and their outputs fit in KV.
    text = f"Notes on {topic}. " + " ".join(f"{topic} fact {i}." for i in range(120))
    return engine.tokenizer.encode(text)[:400]


def test_a_short_prompt_is_prefilled_on_decode_with_no_handoff(client, engine):
    prompt = engine.tokenizer.encode("Name a colour:")
    assert len(prompt) <= LOCAL_TOKENS
    before = _stats("DecodeServer")["handoff"]
    got = client.generate_unary(_greedy(prompt, max_tokens=MAX_TOKENS))
    after = _stats("DecodeServer")["handoff"]
    assert list(got.token_ids) == _expected(engine, [prompt])[0]
    assert after["num_local_prefills"] - before["num_local_prefills"] == 1
    assert after["local_prefill_tokens"] - before["local_prefill_tokens"] == len(prompt)
    assert after["num_handoffs"] == before["num_handoffs"]
    wait_for(_all_free, "every block to be free", timeout_s=30)


def test_a_prompt_arriving_while_decode_waits_on_prefill_is_prefilled_on_decode(client, engine):
    prompts = [_long_prompt(engine, topic) for topic in ("rivers", "comets")]
    assert len(prompts[0]) == 400
    before = _stats("DecodeServer")["handoff"]
    # One handle for the polls: a fresh one a poll (its first call sets up its routing)
    # could space them past the first's prefill call.
    decode = serve.get_deployment_handle("DecodeServer", app_name=APP)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.generate_unary, _greedy(prompts[0], max_tokens=MAX_TOKENS))
        # The first is waiting on the prefill pool when the second comes.
        pending = lambda: decode.stats.remote().result()["pending_prefills"] == 1  # noqa: E731
        wait_for(pending, "the first's prefill call", timeout_s=60, poll_s=0.01)
        second = pool.submit(client.generate_unary, _greedy(prompts[1], max_tokens=MAX_TOKENS))
        got = [list(f.result(timeout=120).token_ids) for f in (first, second)]
    after = _stats("DecodeServer")["handoff"]
    assert got == _expected(engine, prompts)
    # One went through the prefill pool (max_pending_prefills=1); decode took the other
    # (the same length: which one does not matter).
    assert len(prompts[0]) == len(prompts[1])
    assert after["num_handoffs"] - before["num_handoffs"] == 1
    assert after["num_local_prefills"] - before["num_local_prefills"] == 1
    assert after["local_prefill_tokens"] - before["local_prefill_tokens"] == len(prompts[0])
    wait_for(_all_free, "every block to be free", timeout_s=30)


def test_local_prefills_are_exported_as_a_metric(client, ray_metrics_port):
    client.generate_unary(_greedy("Hi", max_tokens=2))  # short: prefilled on decode

    def exported() -> float:
        samples = _scrape(ray_metrics_port).get("ray_baton_local_prefills_total", [])
        return sum(v for labels, v in samples if f'app="{APP}"' in labels)

    # Ray exports on an interval.
    wait_for(lambda: exported() >= 1, "ray_baton_local_prefills_total", timeout_s=60)


def test_status_shows_decodes_local_prefills(client):
    from serve_app.ops.status_text import status_lines

    client.generate_unary(_greedy("Hi", max_tokens=2))  # short: prefilled on decode

    def decode_line() -> str | None:
        lines = status_lines(service_ops.status(APP, BOARD))
        line = next((x for x in lines if x.startswith("  decode ")), None)
        return line if line and "local prefills" in line else None

    # Replicas post to the board about once a second.
    assert re.search(r"local prefills [1-9]", wait_for(decode_line, "a posted local prefill"))
