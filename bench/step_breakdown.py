"""Where an engine step's time goes, in process: a single stream's decode step, a
32-stream decode step, a 512-token prefill and a 64-token prefill over 960 cached
tokens (a prefix cache hit), on the bundled model.

Each part is timed by wrapping the functions that do it (a timer call each, about a
microsecond, which the `python_and_rest` share includes):
- `fused_layers`: a pure-decode step's layers in one C call (fused_decode.py), where
  the model takes it; the parts below are then the prefill's, and --modules runs every
  step on the modules to split a decode step into them;
- `layer_matmuls`: the projections (the block kernel up to `block_rows_limit()` rows,
  the float32 copy above: dense panels on AVX-512, oneDNN elsewhere);
- `lm_head`: the output projection and any final soft-capping;
- `attention`: paged attention, the KV write included;
- `small_kernels`: RMSNorm (with the residual add), rope and the gated activation
  (the Llama family's; other families' rope is counted in the rest);
- `runner_prep`: the runner's step inputs, metadata and block tables;
- `sampling`: the sampler;
- `python_and_rest`: everything else (module dispatch, the scheduler, views, outputs).
Printed per scenario and part: milliseconds per step and share of the step, then the
step's total and its page faults (memory the step touched fresh); --threads sets
torch's threads as an engine of that many would have.

    .venv/bin/python bench/step_breakdown.py [--model smollm2-135m-instruct] [--threads 1]
        [--steps 64] [--modules]
"""

from __future__ import annotations

import argparse
import resource
import time
import uuid
from collections import defaultdict
from collections.abc import Callable

import torch
from common import TOPICS, emit, git_commit, log, topic_prompt

from workers.engine import llm_engine
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model import mlp, norm
from workers.model.attention import PagedAttention
from workers.model.bundled_model import BUNDLED_MODELS, DEFAULT_MODEL
from workers.model.fused_decode import FusedDecode
from workers.model.model_cache import ensure_model
from workers.model.models import llama
from workers.model.models.causal_lm import CausalLM
from workers.model.parallel import PackableLinear
from workers.runner.model_runner import ModelRunner

_spent: dict[str, float] = defaultdict(float)
_depth = [0]  # nested timers (the LM head's matmul) count once, in the outer part


def _timed(part: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        if _depth[0]:
            return fn(*args, **kwargs)
        _depth[0] += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[part] += time.perf_counter() - start
            _depth[0] -= 1

    return wrapper


def _instrument() -> None:
    FusedDecode.__call__ = _timed("fused_layers", FusedDecode.__call__)
    PackableLinear.matmul = _timed("layer_matmuls", PackableLinear.matmul)
    CausalLM.compute_logits = _timed("lm_head", CausalLM.compute_logits)
    PagedAttention.forward = _timed("attention", PagedAttention.forward)
    norm.RMSNorm.forward = _timed("small_kernels", norm.RMSNorm.forward)
    mlp._kernel_gated = _timed("small_kernels", mlp._kernel_gated)
    # Bound by name where they are called.
    llama.apply_rope = _timed("small_kernels", llama.apply_rope)
    ModelRunner._metadata = _timed("runner_prep", ModelRunner._metadata)
    llm_engine.sample_with_drafts = _timed("sampling", llm_engine.sample_with_drafts)


def _measure(
    engine: LLMEngine, prompts: list[list[int]], decode: bool, steps: int, cached: int = 0
):
    """(seconds per step, {part: seconds per step}, page faults per step) over `steps`
    decode steps of the prompts' sequences, or over their prefill step; the first
    `cached` tokens of each prompt are prefilled (and cached) beforehand, not measured."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    if cached:
        for p in prompts:
            engine.add_request(uuid.uuid4().hex, p[:cached], SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
    hits = engine.stats().prefix_cache_hits
    for p in prompts:
        engine.add_request(uuid.uuid4().hex, p, params)
    if decode:
        engine.step()  # the prefill, not measured
    _spent.clear()
    counted = steps if decode else 1
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(counted):
        engine.step()
    total = (time.perf_counter() - start) / counted
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / counted
    parts = {k: v / counted for k, v in _spent.items()}
    hits = engine.stats().prefix_cache_hits - hits
    if hits != len(prompts) * (cached - cached % engine.config.block_size):
        raise RuntimeError(f"the prompts hit {hits} cached tokens; {cached} each were meant to")
    while engine.has_unfinished():
        engine.step()
    return total, parts, faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(BUNDLED_MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument(
        "--modules", action="store_true", help="run decode steps on the modules, not fused"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _instrument()
    model_dir = ensure_model(BUNDLED_MODELS[args.model])
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), num_threads=args.threads, enable_prefix_caching=True)
    )
    if args.modules:
        engine.runner.model.fused_decode = None
    tok = engine.tokenizer
    _measure(engine, [topic_prompt(tok, TOPICS[0], 32)], True, 8)  # warm-up

    def fresh(name: str, i: int, length: int) -> list[int]:
        """A prompt no other scenario's shares a block with (the cache is on)."""
        return (tok.encode(f"{name} {i}:") + topic_prompt(tok, TOPICS[i % len(TOPICS)], length))[
            :length
        ]

    # (prompts, decode steps or prefill, tokens cached beforehand)
    scenarios = {
        "decode_1": ([fresh("decode_1", 0, 32)], True, 0),
        "decode_32": ([fresh("decode_32", i, 32) for i in range(32)], True, 0),
        "prefill_512": ([fresh("prefill_512", 1, 512)], False, 0),
        "prefill_64_cached_960": ([fresh("prefill_cached", 2, 1024)], False, 960),
    }
    context = {
        "model": args.model,
        "threads": args.threads,
        "fused": engine.runner.model.fused_decode is not None,
        "commit": git_commit(),
    }
    for name, (prompts, decode, cached) in scenarios.items():
        total, parts, faults = _measure(engine, prompts, decode, args.steps, cached)
        parts["python_and_rest"] = total - sum(parts.values())
        for part, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
            emit(
                f"step.{name}.{part}_ms",
                seconds * 1e3,
                "ms",
                share=round(seconds / total, 3),
                **context,
            )
            log(f"{name:22s} {part:16s} {seconds * 1e3:8.2f} ms  {seconds / total:6.1%}")
        emit(f"step.{name}.total_ms", total * 1e3, "ms", **context)
        emit(f"step.{name}.page_faults", faults, "faults", **context)
        log(f"{name:22s} {'total':16s} {total * 1e3:8.2f} ms  ({faults:.0f} page faults)")


if __name__ == "__main__":
    main()
