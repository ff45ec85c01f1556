"""The service on the bundled Gemma 3 270M, as `baton serve --model gemma3-270m` deploys it.

Disaggregated with prefill at TP 1 and decode at TP 2 (both decode ranks hold the model's
single KV head, so each handoff fans one part out to two ranks): the service must answer
what the in-process engine does, past the 512-token window too, and name the model.
"""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from ray import serve
from service_helpers import _greedy

from serve_app.config import AppConfig, PoolConfig
from serve_app.ops import service_ops
from serve_app.ops.client import BatonClient
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

KV = 96 * 2**20
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "A long story. " + "The river ran past the mill and under the old stone bridge. " * 60,
]


@pytest.fixture(scope="module")
def gemma_service(ray_cluster, gemma3_dir, serve_ports):
    config = AppConfig(
        model="gemma3-270m",
        mode="disaggregated",
        prefill=PoolConfig(kv_cache_bytes=KV),
        decode=PoolConfig(tensor_parallel_size=2, kv_cache_bytes=KV),
    )
    service_ops.deploy(config, app_name="gemma", route_prefix="/gemma", **serve_ports)
    try:
        yield {
            "http": f"http://127.0.0.1:{serve_ports['http_port']}/gemma",
            "grpc": f"127.0.0.1:{serve_ports['grpc_port']}",
        }
    finally:
        serve.shutdown()


def test_the_service_answers_as_the_engine_does(gemma_service, gemma3_dir):
    engine = LLMEngine(EngineConfig(model=str(gemma3_dir), kv_cache_bytes=KV))
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = engine.generate([engine.tokenizer.encode(p) for p in PROMPTS], params)
    assert len(engine.tokenizer.encode(PROMPTS[-1])) > 700  # past the sliding window
    with BatonClient(gemma_service["grpc"], application="gemma") as client:
        info = client.model_info()
        assert info.model_id == "gemma3-270m"
        for prompt, seq in zip(PROMPTS, expected, strict=True):
            got = client.generate_unary(_greedy(prompt, max_tokens=16))
            assert (list(got.token_ids), got.text) == (seq.output_token_ids, seq.detokenizer.text)
    with urllib.request.urlopen(f"{gemma_service['http']}/v1/models") as reply:
        assert [m["id"] for m in json.load(reply)["data"]] == ["gemma3-270m"]
    sdk = openai.OpenAI(base_url=f"{gemma_service['http']}/v1", api_key="none")
    completion = sdk.completions.create(
        model="gemma3-270m", prompt=PROMPTS[0], max_tokens=16, temperature=0.0
    )
    assert completion.choices[0].text == expected[0].detokenizer.text
