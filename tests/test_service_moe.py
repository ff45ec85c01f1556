"""The disaggregated service on a mixture-of-experts model (`baton serve --model DIR` on a
random-weight Qwen3-MoE folder): prefill at TP 1, decode at TP 2 (each rank holding its
slice of every expert); greedy output must be the in-process engine's. (Every ported
architecture runs from its folder with `baton generate --local`: test_architectures_cli.py.)"""

from __future__ import annotations

import json
import urllib.request

import pytest
from arch_checks import make_architecture
from ray import serve
from service_helpers import _greedy

from serve_app.config import AppConfig, PoolConfig
from serve_app.ops import service_ops
from serve_app.ops.client import BatonClient
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

KV = 16 * 2**20
PROMPTS = ["The river ran past the mill", "def fibonacci(n):", "A long story. " * 20]


@pytest.fixture(scope="module", autouse=True)
def _serve_stops_after(ray_cluster):
    """Serve's ports are fixed when it starts: the next module starts its own."""
    yield
    serve.shutdown()


def _served_matches_engine(config: AppConfig, model_dir, serve_ports, app: str) -> None:
    service_ops.deploy(config, app_name=app, route_prefix=f"/{app}", **serve_ports)
    try:
        engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_bytes=KV))
        params = SamplingParams(max_tokens=16, temperature=0.0)
        expected = engine.generate([engine.tokenizer.encode(p) for p in PROMPTS], params)
        with BatonClient(f"127.0.0.1:{serve_ports['grpc_port']}", application=app) as client:
            assert client.model_info().model_id == model_dir.name
            for prompt, seq in zip(PROMPTS, expected, strict=True):
                got = client.generate_unary(_greedy(prompt, max_tokens=16))
                assert list(got.token_ids) == seq.output_token_ids
        url = f"http://127.0.0.1:{serve_ports['http_port']}/{app}/v1/models"
        with urllib.request.urlopen(url) as reply:
            assert [m["id"] for m in json.load(reply)["data"]] == [model_dir.name]
    finally:
        serve.delete(app)


def test_a_moe_model_through_the_disaggregated_service(ray_cluster, serve_ports, tmp_path):
    model_dir = make_architecture("qwen3_moe", tmp_path / "tiny-qwen3-moe")
    config = AppConfig(
        model=str(model_dir),
        mode="disaggregated",
        prefill=PoolConfig(kv_cache_bytes=KV),
        decode=PoolConfig(tensor_parallel_size=2, kv_cache_bytes=KV),
    )
    _served_matches_engine(config, model_dir, serve_ports, "moe")
