"""The engine on a CUDA device, against the CPU engine (the fidelity reference, itself
checked against transformers in test_smollm2_fidelity.py). Needs a GPU: CI deselects
them (`-m "not gpu"`); run `pytest -m gpu` on a machine with one."""

from __future__ import annotations

import pytest
from handoff_helpers import _drain

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.kv.blocks import KVBlocks

pytestmark = pytest.mark.gpu

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "日本の首都は東京です。東京は",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 64, **overrides}))


def test_cuda_float32_decodes_as_the_cpu_engine(smollm2_dir):
    cpu = _engine(smollm2_dir, device="cpu", dtype="float32")
    cuda = _engine(smollm2_dir, device="cuda", dtype="float32")
    for text in PROMPTS:
        prompt = cpu.tokenizer.encode(text)
        (want,) = cpu.generate([prompt], GREEDY)
        (got,) = cuda.generate([prompt], GREEDY)
        assert got.output_token_ids == want.output_token_ids, text
        # Same kernels' math in another order: the first token's logprob agrees closely.
        assert abs(got.output_logprobs[0].logprob - want.output_logprobs[0].logprob) < 1e-3
    assert cuda.stats().num_free_blocks == cuda.stats().num_total_blocks


def test_cuda_decodes_a_batch_as_the_cpu_engine(smollm2_dir):
    # Decode steps of several sequences: SDPA's output layout on CUDA differs from one
    # sequence's (a view of it failed every such step once).
    cpu = _engine(smollm2_dir, device="cpu", dtype="float32")
    cuda = _engine(smollm2_dir, device="cuda", dtype="float32")
    prompts = [cpu.tokenizer.encode(text) for text in PROMPTS]
    want = cpu.generate(prompts, GREEDY)
    got = cuda.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert cuda.stats().num_free_blocks == cuda.stats().num_total_blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_scores_prompts_and_decodes_after_a_cached_prefix(smollm2_dir, dtype):
    # What the service's GPU pools do beyond a plain decode: prompt logprobs (computed in
    # slices on the device), a prefill chunk on a cached prefix (its mask through SDPA),
    # and bfloat16, CUDA's default, against the float32 CPU engine.
    cpu = _engine(smollm2_dir, device="cpu", dtype="float32")
    cuda = _engine(smollm2_dir, device="cuda", dtype=dtype)
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    prompt = cpu.tokenizer.encode(PROMPTS[1])
    (want,) = cpu.generate([prompt], scored)
    (got,) = cuda.generate([prompt], scored)
    close = 1e-3 if dtype == "float32" else 0.25
    assert [lp.token_id for lp in got.prompt_logprobs] == prompt[1:]
    for g, w in zip(got.prompt_logprobs, want.prompt_logprobs, strict=True):
        assert abs(g.logprob - w.logprob) < close and g.rank >= 1
    long = cpu.tokenizer.encode(PROMPTS[0] * 6)
    cuda.generate([long], GREEDY)
    (again,) = cuda.generate([long + cpu.tokenizer.encode(" Paris")], GREEDY)
    assert again.num_cached_tokens > 0 and len(again.output_token_ids) == GREEDY.max_tokens
    if dtype == "float32":
        (cpu_again,) = cpu.generate([long + cpu.tokenizer.encode(" Paris")], GREEDY)
        assert again.output_token_ids == cpu_again.output_token_ids
    assert cuda.stats().num_free_blocks == cuda.stats().num_total_blocks


def test_a_bfloat16_cuda_prefill_hands_its_kv_to_a_float32_cpu_decode(smollm2_dir):
    # "auto" is bfloat16 on CUDA; the import converts the KV to the decode engine's dtype.
    prefill = _engine(smollm2_dir, device="cuda")
    decode = _engine(smollm2_dir, device="cpu", dtype="float32")
    assert prefill.config.resolved_dtype_name() == "bfloat16"
    prompt = decode.tokenizer.encode(PROMPTS[0] * 6)  # a few full blocks
    prefill.add_request("r", prompt, GREEDY, prefill_only=True)
    (first,) = _drain(prefill)["r"]
    assert first.handoff is not None
    handle, parts = prefill.export_kv("r")
    assert all(isinstance(p, KVBlocks) and p.data.device.type == "cpu" for p in parts)
    decode.add_prefilled_request("r", prompt, GREEDY, handle, parts)
    assert prefill.release_handoff("r")
    rest = _drain(decode)["r"]
    assert sum(len(o.new_token_ids) for o in rest) == GREEDY.max_tokens
    assert rest[-1].finished
    for engine in (prefill, decode):
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
