"""Prefix caching: what a cache hit saves, and what caching costs when nothing hits.

Prints JSON lines, all measured in one run on the default model:
- ttft_1024.hit / ttft_1024.miss: time to the first token of a 1,024-token prompt
  whose first 960 tokens were computed before (same cache salt) vs the same prompt
  on a cold cache (a salt never seen), and ratio.ttft_1024.hit_over_miss;
- c8_tok_s_0pct_hit.cache_on / cache_off: aggregate output tokens/s of 8 concurrent
  requests with distinct prompts (128 new tokens each) on an engine with prefix
  caching on vs one with it off, and ratio.c8_tok_s_0pct_hit.cache_on_over_off.
Hit and miss, on and off alternate round by round and medians are reported, since
absolute speed drifts on a shared 2-core machine.

    .venv/bin/python bench/prefix_cache.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import TOPICS, cpu_count, emit, git_commit, log, median, topic_prompt  # noqa: E402

from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.llm_engine import LLMEngine  # noqa: E402
from workers.engine.sampling_params import SamplingParams  # noqa: E402
from workers.model.model_cache import ensure_default_model  # noqa: E402

PROMPT_TOKENS = 1024
SEEN_TOKENS = 960  # 60 full blocks of 16
CONCURRENCY = 8
NEW_TOKENS = 128
THROUGHPUT_PROMPT_TOKENS = 64


def ttft(engine: LLMEngine, prompt: list[int], salt: str) -> tuple[float, int, int]:
    """(seconds to the first token, the token, prompt tokens served from the cache)."""
    rid = uuid.uuid4().hex
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), salt)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                return time.perf_counter() - start, out.new_token_ids[0], out.num_cached_tokens
    raise RuntimeError("the request finished without a token")


def throughput(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    """Aggregate output tokens/s; every request gets a salt never used before, so none hits."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    hits_before = engine.stats().prefix_cache_hits
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(uuid.uuid4().hex, p, params, cache_salt=f"{tag}-{i}")
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    if engine.stats().prefix_cache_hits != hits_before:
        raise RuntimeError("the 0%-hit workload hit the cache; its prompts must be distinct")
    return produced / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, cpu_count()))
    args = parser.parse_args()

    model_dir = ensure_default_model()
    cache_on = LLMEngine(EngineConfig(model=str(model_dir), num_threads=args.threads))
    cache_off = LLMEngine(
        EngineConfig(model=str(model_dir), num_threads=args.threads, enable_prefix_caching=False)
    )
    tok = cache_on.tokenizer
    seen = topic_prompt(tok, "the history of computing", SEEN_TOKENS)
    tail = PROMPT_TOKENS - SEEN_TOKENS
    warm_prompt = seen + topic_prompt(tok, "the deep sea", tail)
    prompt = seen + topic_prompt(tok, "mountain weather", tail)
    batch = [topic_prompt(tok, t, THROUGHPUT_PROMPT_TOKENS) for t in TOPICS[:CONCURRENCY]]

    results: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)
        log(f"  {name:28s} {value:.4f}")

    # Warm-up: first calls allocate and fault in weights.
    for engine in (cache_on, cache_off):
        ttft(engine, prompt, "warm-up")
        throughput(engine, batch[:2], f"warm-up-{id(engine)}")

    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        # Fresh salts per round, so nothing carries over from the rounds before.
        measured: dict[str, tuple[float, int, int]] = {}
        for kind in ("miss", "hit") if r % 2 == 0 else ("hit", "miss"):
            if kind == "hit":
                # Another request computes the shared 960 tokens under this salt first.
                ttft(cache_on, warm_prompt, f"seen-{r}")
                measured[kind] = ttft(cache_on, prompt, f"seen-{r}")
            else:
                measured[kind] = ttft(cache_on, prompt, f"cold-{r}")
        (miss_s, miss_token, miss_cached), (hit_s, hit_token, hit_cached) = (
            measured["miss"],
            measured["hit"],
        )
        if miss_cached != 0 or hit_cached != SEEN_TOKENS:
            raise RuntimeError(
                f"expected 0 and {SEEN_TOKENS} cached, got {miss_cached, hit_cached}"
            )
        if hit_token != miss_token:
            raise RuntimeError("a cache hit changed the greedy first token")
        record("ttft_1024.miss", miss_s)
        record("ttft_1024.hit", hit_s)

        order = [(cache_on, "cache_on"), (cache_off, "cache_off")]
        for engine, name in order if r % 2 == 0 else order[::-1]:
            record(f"c8_tok_s_0pct_hit.{name}", throughput(engine, batch, f"tp-{r}"))

    context = {
        "model": model_dir.name,
        "threads": args.threads,
        "rounds": args.rounds,
        "git_commit": git_commit(),
    }
    ttft_context = {**context, "prompt_tokens": PROMPT_TOKENS, "cached_tokens": SEEN_TOKENS}
    tp_context = {
        **context,
        "concurrency": CONCURRENCY,
        "prompt_tokens": THROUGHPUT_PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS,
    }
    for name, values in results.items():
        unit = "s" if name.startswith("ttft") else "tok/s"
        emit(name, median(values), unit, **(ttft_context if unit == "s" else tp_context))
    emit(
        "ratio.ttft_1024.hit_over_miss",
        median(results["ttft_1024.hit"]) / median(results["ttft_1024.miss"]),
        "ratio",
        **ttft_context,
    )
    emit(
        "ratio.c8_tok_s_0pct_hit.cache_on_over_off",
        median(results["c8_tok_s_0pct_hit.cache_on"])
        / median(results["c8_tok_s_0pct_hit.cache_off"]),
        "ratio",
        **tp_context,
    )


if __name__ == "__main__":
    main()
