"""Engine vs Hugging Face transformers on the same model and prompts, in one run.

Prints JSON lines: single-stream decode tokens/s (32-token prompt, 128 new
tokens), aggregate tokens/s at 8 and 32 concurrent requests (128 new tokens
each), TTFT of a 512- and a 2,048-token prompt, and ratio.*.engine_over_hf for
each; the KV cache's bytes per token, with every layer keeping the whole context and
as an 8k-token sequence holds them, and a 2,048-token handoff's bytes (kv_figures).
--model picks a bundled model (its GGUF is what transformers loads) or a Hugging Face
folder (bench/random_moe.py writes a mixture of experts of realistic shape). The single stream
is also measured with n-gram speculative decoding on both sides
(`engine_ngram`: EngineConfig.speculative; `hf_ngram`: generate's prompt lookup
with as many tokens), each against plain transformers and against the other.
Measurements alternate engine / transformers round by round and report the
median, since absolute speed drifts on a shared 2-core machine. Both run in
--dtype (float32 by default; bfloat16 is the fast path on CPUs with AMX or
AVX512-BF16) on --device (cpu by default, or cuda), which every line carries.

    .venv/bin/python bench/engine.py [--model smollm2-135m-instruct|gemma3-270m|DIR] [--rounds 2]
        [--threads 2] [--dtype float32] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import TOPICS, cpu_count, emit, git_commit, log, median, topic_prompt  # noqa: E402

from workers.engine.config import EngineConfig, SpeculativeConfig  # noqa: E402
from workers.engine.llm_engine import LLMEngine  # noqa: E402
from workers.engine.sampling_params import SamplingParams  # noqa: E402
from workers.model.bundled_model import BUNDLED_MODELS, DEFAULT_MODEL  # noqa: E402
from workers.model.model_cache import ensure_gguf, ensure_model  # noqa: E402

NEW_TOKENS = 128


def engine_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(aggregate output tokens/s, seconds to the first token of the first request)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(uuid.uuid4().hex, p, params)
    first, produced = None, 0
    while engine.has_unfinished():
        outs = engine.step()
        produced += sum(len(o.new_token_ids) for o in outs)
        if first is None and outs:
            first = time.perf_counter() - start
    return produced / (time.perf_counter() - start), first


def hf_run(
    model, prompts: list[list[int]], max_tokens: int, **generate_kwargs
) -> tuple[float, float]:
    """transformers' batched generate with left padding; (tokens/s, seconds)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            **generate_kwargs,
        )
    if out.is_cuda:  # generate returns before the GPU has finished
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == max_tokens
    return len(prompts) * max_tokens / elapsed, elapsed


def kv_figures(engine: LLMEngine) -> list[tuple[str, float, str]]:
    """The KV cache's bytes per token with every layer keeping the whole context; what an
    8k-token sequence holds of the pool (a sliding-window layer keeps only its window)
    against that; and the bytes a KV handoff of a 2,048-token prompt moves against an
    all-layers handoff, measured on a real export."""
    block_bytes = engine.kv_cache_bytes / engine.kv.num_blocks
    groups, block_size = engine.kv.groups, engine.config.block_size
    all_layers_per_token = block_bytes * groups.num_groups / block_size
    held_8k = groups.blocks_needed(8192, 1, block_size)
    all_full_8k = groups.num_groups * -(-8192 // block_size)
    prompt = [(7 * i) % 1000 + 100 for i in range(2048)]
    engine.add_request("handoff", prompt, SamplingParams(max_tokens=2), prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    _, parts = engine.export_kv("handoff", skip_blocks=0)
    moved = sum(p.nbytes for p in parts)
    all_layers = engine.stats().kv_blocks_exported_all_layers * block_bytes
    engine.release_handoff("handoff")
    return [
        ("engine.kv_bytes_per_token", all_layers_per_token, "B"),
        ("engine.kv_bytes_per_token_8k", held_8k * block_bytes / 8192, "B"),
        ("ratio.kv_blocks_8k.hybrid_over_all_full", held_8k / all_full_8k, "ratio"),
        ("engine.handoff_bytes_2048", moved, "B"),
        ("ratio.handoff_bytes_2048.windowed_over_all_layers", moved / all_layers, "ratio"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a bundled model ({', '.join(sorted(BUNDLED_MODELS))}) or a Hugging Face folder",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=min(2, cpu_count()))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    if args.model in BUNDLED_MODELS:
        model_dir = ensure_model(BUNDLED_MODELS[args.model])
        gguf = ensure_gguf(BUNDLED_MODELS[args.model])
        # transformers loads the bundled model's own GGUF file.
        reference = {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name}
    else:
        model_dir = Path(args.model)
        reference = {"pretrained_model_name_or_path": str(model_dir)}
    # Prefix caching off: rounds repeat the same prompts, and a cache hit would
    # measure the cache (bench/prefix_cache.py does), not the engine against HF.
    config = EngineConfig(
        model=str(model_dir),
        num_threads=args.threads,
        enable_prefix_caching=False,
        dtype=args.dtype,
        device=args.device,
    )
    engine = LLMEngine(config)
    speculative = SpeculativeConfig()
    engine_ngram = LLMEngine(replace(config, speculative=speculative))
    lookup = {"prompt_lookup_num_tokens": speculative.num_tokens}
    log(f"loading transformers' reference from {reference['pretrained_model_name_or_path']}")
    hf = (
        AutoModelForCausalLM.from_pretrained(**reference, dtype=getattr(torch, args.dtype))
        .eval()
        .to(args.device)
    )
    tok = engine.tokenizer
    single = [topic_prompt(tok, TOPICS[0], 32)]
    batches = {c: [topic_prompt(tok, TOPICS[i], 32) for i in range(c)] for c in (8, 32)}
    long_prompts = {n: [topic_prompt(tok, TOPICS[1], n)] for n in (512, 2048)}

    results: dict[str, dict[str, list[float]]] = {}

    def record(name: str, system: str, value: float) -> None:
        results.setdefault(name, {}).setdefault(system, []).append(value)
        log(f"  {name:20s} {system:7s} {value:.3f}")

    # Warm-up at every shape measured: first calls allocate, fault in weights and (on
    # CUDA) pick kernels, which made a first 512-token prefill many times slower.
    for prompts in (single, *batches.values(), *long_prompts.values()):
        engine_run(engine, prompts, 8)
        hf_run(hf, prompts, 8)
    engine_run(engine_ngram, single, 8)
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        record("single_stream_tok_s", "engine", engine_run(engine, single, NEW_TOKENS)[0])
        record("single_stream_tok_s", "hf", hf_run(hf, single, NEW_TOKENS)[0])
        ngram = engine_run(engine_ngram, single, NEW_TOKENS)[0]
        record("single_stream_tok_s", "engine_ngram", ngram)
        record("single_stream_tok_s", "hf_ngram", hf_run(hf, single, NEW_TOKENS, **lookup)[0])
        for c, prompts in batches.items():
            record(f"c{c}_tok_s", "engine", engine_run(engine, prompts, NEW_TOKENS)[0])
            record(f"c{c}_tok_s", "hf", hf_run(hf, prompts, NEW_TOKENS)[0])
        for n, prompt in long_prompts.items():
            record(f"ttft_{n}", "engine", engine_run(engine, prompt, 1)[1])
            record(f"ttft_{n}", "hf", hf_run(hf, prompt, 1)[1])

    context = {
        "model": model_dir.name,
        "threads": args.threads,
        "dtype": args.dtype,
        "device": args.device,
        "rounds": args.rounds,
        "new_tokens": NEW_TOKENS,
        "git_commit": git_commit(),
    }
    for name, value, unit in kv_figures(engine):
        emit(name, value, unit, **context)
    ratios = [("engine", "hf"), ("engine_ngram", "hf"), ("engine_ngram", "hf_ngram")]
    for name, by_system in results.items():
        unit = "s" if name.startswith("ttft") else "tok/s"
        for system, values in by_system.items():
            emit(f"{system}.{name}", median(values), unit, **context)
        for ours, theirs in ratios:
            if ours in by_system and theirs in by_system:
                value = median(by_system[ours]) / median(by_system[theirs])
                extra = {"speculative": asdict(speculative)} if ours == "engine_ngram" else {}
                emit(f"ratio.{name}.{ours}_over_{theirs}", value, "ratio", **context, **extra)


if __name__ == "__main__":
    main()
