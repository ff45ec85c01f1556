"""Shared fixtures: the real default model (cached across runs), tiny synthetic GGUF files and
a tiny random Llama, the Helm chart, and a private Ray with the Serve service on it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# How often the test Ray's workers export metrics (ray_cluster).
METRICS_EXPORT_S = 2.0


# No test may reach the Hugging Face hub (it is unreachable where this suite runs, and
# everything needed is local). huggingface_hub reads this once at import, so it is set here,
# before any test module imports transformers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Serve keeps a router replica (its direct ingress) serving this long after it is told to
# stop, for load balancers on other nodes to drop it (30 s by default). Here HAProxy runs
# beside it, and every module's Serve shutdown would wait that long. Ray's processes,
# `baton serve`'s included, inherit it from the test process.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")

# Kept small enough that writing + converting one takes milliseconds.
TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "ctx": 128}
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġ Ġ"]


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows (written out independently)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _byte_alphabet() -> list[str]:
    # GPT-2's printable stand-ins for the 256 byte values, as byte-level BPE vocabularies use.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tied: bool = True,
    skip_keys: Iterable[str] = (),
    overrides: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    seed: int = 0,
    quantized: bool = False,
) -> dict[str, np.ndarray]:
    """Write a tiny random Llama GGUF the way llama.cpp lays one out; `quantized` stores
    the projections as Q4_1 and the embedding (and an untied output) as Q8_0, as a
    Q4_1 llama.cpp file does.

    Returns the weights in Hugging Face layout (Q/K unpermuted, Q8_0 ones as they dequantize),
    i.e. exactly what a correct converter must produce.
    """
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    tokens = TINY_SPECIALS + _byte_alphabet() + [m.replace(" ", "") for m in TINY_MERGES]
    types = [3] * len(TINY_SPECIALS) + [1] * (len(tokens) - len(TINY_SPECIALS))
    t = TINY
    head_dim = t["hidden"] // t["heads"]
    kv_rows = t["kv_heads"] * head_dim

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    writer = GGUFWriter(str(path), arch)
    keys: dict[str, tuple[Callable[..., None], Any]] = {
        f"{arch}.context_length": (writer.add_uint32, t["ctx"]),
        f"{arch}.embedding_length": (writer.add_uint32, t["hidden"]),
        f"{arch}.block_count": (writer.add_uint32, t["layers"]),
        f"{arch}.feed_forward_length": (writer.add_uint32, t["ffn"]),
        f"{arch}.attention.head_count": (writer.add_uint32, t["heads"]),
        f"{arch}.attention.head_count_kv": (writer.add_uint32, t["kv_heads"]),
        f"{arch}.rope.freq_base": (writer.add_float32, 50000.0),
        f"{arch}.attention.layer_norm_rms_epsilon": (writer.add_float32, 1e-5),
        f"{arch}.vocab_size": (writer.add_uint32, len(tokens)),
        "tokenizer.ggml.model": (writer.add_string, "gpt2"),
        "tokenizer.ggml.pre": (writer.add_string, "smollm"),
        "tokenizer.ggml.tokens": (writer.add_array, tokens),
        "tokenizer.ggml.token_type": (writer.add_array, types),
        "tokenizer.ggml.merges": (writer.add_array, TINY_MERGES),
        "tokenizer.ggml.bos_token_id": (writer.add_uint32, 1),
        "tokenizer.ggml.eos_token_id": (writer.add_uint32, 2),
        "tokenizer.ggml.padding_token_id": (writer.add_uint32, 2),
        "tokenizer.ggml.add_bos_token": (writer.add_bool, False),
        "tokenizer.chat_template": (writer.add_string, "{{ messages[0]['content'] }}"),
    }
    for key, (add, value) in keys.items():
        if key not in set(skip_keys):
            add(key, (overrides or {}).get(key, value))

    expected: dict[str, np.ndarray] = {}

    def put(
        gguf_name: str,
        hf_name: str,
        hf_value: np.ndarray,
        n_head: int = 0,
        qtype: GGMLQuantizationType | None = None,
    ) -> None:
        stored = llama_cpp_permute(hf_value, n_head) if n_head else hf_value
        if qtype is None:
            writer.add_tensor(gguf_name, stored)
        else:
            # Blocks run along rows, so quantizing commutes with the row permutation.
            hf_value = dequantize(quantize(hf_value, qtype), qtype)
            writer.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)
        expected[hf_name] = hf_value

    q4 = GGMLQuantizationType.Q4_1 if quantized else None
    q8 = GGMLQuantizationType.Q8_0 if quantized else None
    put("token_embd.weight", "model.embed_tokens.weight", rand(len(tokens), t["hidden"]), qtype=q8)
    for i in range(t["layers"]):
        hf = f"model.layers.{i}."
        put(
            f"blk.{i}.attn_q.weight",
            hf + "self_attn.q_proj.weight",
            rand(t["hidden"], t["hidden"]),
            t["heads"],
            q4,
        )
        # Always one quantized tensor, so dequantization and unpermutation are exercised
        # together.
        put(
            f"blk.{i}.attn_k.weight",
            hf + "self_attn.k_proj.weight",
            rand(kv_rows, t["hidden"]),
            t["kv_heads"],
            q4 or GGMLQuantizationType.Q8_0,
        )
        for gguf_leaf, hf_leaf, shape in (
            ("attn_v", "self_attn.v_proj", (kv_rows, t["hidden"])),
            ("attn_output", "self_attn.o_proj", (t["hidden"], t["hidden"])),
            ("ffn_gate", "mlp.gate_proj", (t["ffn"], t["hidden"])),
            ("ffn_up", "mlp.up_proj", (t["ffn"], t["hidden"])),
            ("ffn_down", "mlp.down_proj", (t["hidden"], t["ffn"])),
        ):
            put(f"blk.{i}.{gguf_leaf}.weight", f"{hf}{hf_leaf}.weight", rand(*shape), qtype=q4)
        put(f"blk.{i}.attn_norm.weight", hf + "input_layernorm.weight", rand(t["hidden"]))
        put(f"blk.{i}.ffn_norm.weight", hf + "post_attention_layernorm.weight", rand(t["hidden"]))
    put("output_norm.weight", "model.norm.weight", rand(t["hidden"]))
    if not tied:
        put("output.weight", "lm_head.weight", rand(len(tokens), t["hidden"]), qtype=q8)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture
def make_tiny_gguf() -> Callable[..., dict[str, np.ndarray]]:
    """`make_tiny_gguf(path, **options)`: see `write_tiny_gguf`."""
    return write_tiny_gguf


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small random-weight Llama folder (tiny_model's defaults), one per module. Used by the
    test_llm_engine*, test_async_engine*, test_kv_cache_copy and test_handoff* modules among
    others; a module wanting another defines its own."""
    from tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def chart():
    """The Helm chart under helm/, loaded with the real Helm library (test_helm_chart*)."""
    import helm_python as helm
    from helm_chart_helpers import CHART

    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted default model, from the user cache (downloaded and converted at most once)."""
    from workers.model.model_cache import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir: Path) -> Path:
    """The GGUF the default model was converted from, kept beside the converted folder."""
    from workers.model.model_cache import ensure_default_gguf

    return ensure_default_gguf()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf: Path):
    """transformers' own float32 model, built by its own GGUF loader (its dequantization,
    its Q/K un-permutation) from the file the default model was converted from: what the
    converter and the engine are held to. Loaded once: it takes ~20 s."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """The bundled Gemma 3 270M, converted, from the user cache (fetched at most once)."""
    from workers.model import resolve_model

    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_dir: Path):
    """transformers' own Gemma 3 270M, loaded by its own GGUF loader (its dequantization)
    from the file the bundled model was converted from."""
    import torch
    from transformers import AutoModelForCausalLM

    from workers.model.bundled_model import bundled_model
    from workers.model.model_cache import ensure_gguf

    gguf = ensure_gguf(bundled_model("gemma3-270m"))
    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_metrics_port() -> int:
    """The port of the test Ray's Prometheus metrics endpoint."""
    return _free_port()


@pytest.fixture(scope="module")
def serve_ports() -> dict:
    """Ports for a module's Serve proxies, as `service_ops.deploy` takes them."""
    return {"http_port": _free_port(), "grpc_port": _free_port(), "http_host": "127.0.0.1"}


@pytest.fixture(scope="session")
def ray_cluster(ray_metrics_port):
    """A private local Ray for the whole session: no dashboard, a short temp dir of its own
    (socket paths must fit in 107 bytes), a fixed metrics port, logical CPUs for TP ranks."""
    import shutil
    import tempfile

    import ray

    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(
        address="local",
        num_cpus=16,
        include_dashboard=False,
        _temp_dir=temp_dir,
        _metrics_export_port=ray_metrics_port,
        # Workers export metrics every 2 s, not Ray's 10: the tests that read them wait
        # for an export, and settle past one (METRICS_EXPORT_S).
        _system_config={"metrics_report_interval_ms": int(METRICS_EXPORT_S * 1000)},
        log_to_driver=False,
        object_store_memory=200 * 2**20,
    )
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def service(request, ray_cluster, smollm2_dir, serve_ports):
    """The service the test_service*.py modules exercise: apps "disagg" and "agg" on one
    Serve instance, on the real model; a module's `SERVICE_APPS` names fewer. Module-scoped:
    a module using it deploys, and shuts down, its own."""
    import ray
    from ray import serve
    from service_helpers import KV, _leftovers

    from serve_app.config import AppConfig, PoolConfig
    from serve_app.ops import service_ops

    # Serve retries a replica it cannot place for ever: a CPU an earlier test left
    # reserved would turn the scaling test into a hang, so find it here (after a grace
    # period: Ray returns a killed actor's CPUs asynchronously).
    total = ray.cluster_resources()["CPU"]
    deadline = time.monotonic() + 10.0
    while (free := ray.available_resources().get("CPU", 0.0)) != total:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"earlier tests left {total - free:g} CPUs reserved: {_leftovers()}"
            )
        time.sleep(0.2)
    disagg = AppConfig(
        mode="disaggregated",
        transport="nixl",  # "disagg_os" in test_service.py runs the object store
        prefill=PoolConfig(tensor_parallel_size=3, kv_cache_bytes=KV),
        # Speculating, so that every comparison of "disagg" with "agg" and the in-process
        # engine also covers n-gram speculative decoding end to end.
        decode=PoolConfig(kv_cache_bytes=KV, speculative_tokens=4),
    )
    # Streams every 3 tokens after the first, so test_service.py's comparisons also cover
    # merged messages through the router's text and stop strings; and over actor calls,
    # so they cover both of the router's output channels ("disagg" streams over gRPC).
    agg = AppConfig(
        mode="aggregated",
        stream_interval=3,
        output_channel="actor_call",
        aggregated=PoolConfig(kv_cache_bytes=KV),
    )
    for name, config in {"disagg": disagg, "agg": agg}.items():
        if name in getattr(request.module, "SERVICE_APPS", ("disagg", "agg")):
            service_ops.deploy(config, app_name=name, route_prefix=f"/{name}", **serve_ports)
    yield {
        "http": f"http://127.0.0.1:{serve_ports['http_port']}",
        "grpc": f"127.0.0.1:{serve_ports['grpc_port']}",
    }
    serve.shutdown()


@pytest.fixture(scope="module")
def disagg(service):
    """A gRPC client of `service`'s "disagg" application."""
    from serve_app.ops.client import BatonClient

    with BatonClient(service["grpc"], application="disagg") as client:
        yield client


@pytest.fixture(scope="module")
def agg(service):
    """A gRPC client of `service`'s "agg" application."""
    from serve_app.ops.client import BatonClient

    with BatonClient(service["grpc"], application="agg") as client:
        yield client


@pytest.fixture(params=["avx2", "avx512"])
def vector_width(request):
    """Runs a test on Baton's CPU kernels' AVX2 forms and on their AVX-512 ones (the same
    AVX2 forms again on a CPU without AVX-512); yields whether AVX-512 runs."""
    from workers.model import kernels

    lib = kernels.library()
    wide = request.param == "avx512"
    try:
        yield bool(lib.baton_use_avx512(int(wide)))
    finally:
        lib.baton_use_avx512(1)
