"""Tensor parallelism on this machine: decode step and prefill time at tp=1 and tp=3,
the all-reduce cost per decode step, and what importing a 512-token KV handoff from a
tp=1 prefill costs a tp=3 decode group: over nixl each rank pulls on its own transfer
thread (off the step), the whole part or, cut for the group, its own KV head, and the
step only writes what is staged; over the object store the engine process cuts each
rank's share and sends it with the call.

tp=1 is the in-process runner with --threads torch threads (a lone engine);
tp=3 is a Ray worker group with one thread per rank. On a 2-core machine three
ranks oversubscribe the cores, so tp=3 is expected to be slower here; the
figures show what the per-step communication costs, to judge the GPU plan. The two
are measured in turn, round by round (medians over --rounds), so that the machine's
drift during a run falls on both.

    .venv/bin/python bench/tensor_parallel.py [--steps 30] [--batch 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import ray
import torch
from common import cpu_count, emit, git_commit, log, median

from workers.model.config import ModelConfig
from workers.model.model_cache import ensure_default_model
from workers.runner.model_runner import ModelRunner
from workers.runner.runner_spec import RunnerSpec
from workers.runner.step_io import SeqChunk, StepInput
from workers.runner.tp_group import TPWorkerGroup

BLOCK = 16
PROMPT_LEN = 32
PREFILL_LEN = 512


def decode_step_s(runner, batch: int, steps: int) -> float:
    """Median seconds of one decode step for `batch` sequences after a 32-token prefill."""
    blocks_per_seq = (PROMPT_LEN + steps + BLOCK) // BLOCK + 1
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    prompts = [[(17 * i + j) % 40000 + 100 for j in range(PROMPT_LEN)] for i in range(batch)]
    runner.execute(
        StepInput([SeqChunk(p, 0, [t], True) for p, t in zip(prompts, tables, strict=True)])
    )
    times = []
    for s in range(steps):
        step = StepInput([SeqChunk([42], PROMPT_LEN + s, [t], True) for t in tables])
        start = time.perf_counter()
        runner.execute(step)
        times.append(time.perf_counter() - start)
    return median(times[3:])


def prefill_s(runner, rounds: int = 3) -> float:
    prompt = [(7 * j) % 40000 + 100 for j in range(PREFILL_LEN)]
    table = list(range(PREFILL_LEN // BLOCK))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        runner.execute(StepInput([SeqChunk(prompt, 0, [table], True)]))
        times.append(time.perf_counter() - start)
    return median(times)


def handoff_import_s(exporter: ModelRunner, group: TPWorkerGroup, rounds: int = 5) -> dict:
    """Median seconds, per transport, of moving the 512-token prompt's blocks (computed by
    prefill_s on `exporter`) into `group`: the rank pull, and the import in the step."""
    blocks = list(range(PREFILL_LEN // BLOCK))
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        # Whole (every rank fetches the one part) and cut for the group's three ranks
        # (each fetches its own KV head), as a decode replica asks for.
        for name, dst_tp in (("nixl", None), ("nixl_cut", group.tp_size)):
            parts = exporter.export_blocks(blocks, 0, "nixl", dst_tp)
            start = time.perf_counter()
            group.prefetch(parts)
            pulled = time.perf_counter()
            group.import_blocks(blocks, parts, 0)
            times.setdefault(f"pull.{name}", []).append(pulled - start)
            times.setdefault(f"import.{name}", []).append(time.perf_counter() - pulled)
        parts = exporter.export_blocks(blocks, 0, "object_store")
        start = time.perf_counter()
        group.import_blocks(blocks, parts, 0)
        times.setdefault("import.object_store", []).append(time.perf_counter() - start)
    return {name: median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=min(2, cpu_count()))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    model_dir = ensure_default_model()
    cfg = ModelConfig.from_pretrained(model_dir)
    num_blocks = max(64, args.batch * ((PROMPT_LEN + args.steps) // BLOCK + 3))
    spec = RunnerSpec(str(model_dir), num_blocks, BLOCK, 2048, torch.float32, "cpu")
    context = {
        "model": model_dir.name,
        "batch": args.batch,
        "rounds": args.rounds,
        "git_commit": git_commit(),
    }

    torch.set_num_threads(args.threads)
    single = ModelRunner(spec.model_dir, spec.num_blocks, BLOCK, spec.max_model_len)
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=3, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        group = TPWorkerGroup(3, spec)
        times: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for name, runner in (("tp1", single), ("tp3", group)):
                log(f"round {r + 1}/{args.rounds}: {name}")
                decode = decode_step_s(runner, args.batch, args.steps)
                times.setdefault(f"{name}.decode", []).append(decode)
                times.setdefault(f"{name}.prefill", []).append(prefill_s(runner))
        tp1_decode, tp1_prefill = median(times["tp1.decode"]), median(times["tp1.prefill"])
        tp3_decode, tp3_prefill = median(times["tp3.decode"]), median(times["tp3.prefill"])
        # Per decode step: two all-reduces per layer (attention and MLP outputs) and
        # one for the vocab-parallel embedding, each over [batch, hidden].
        per_call = group.time_all_reduce(args.batch * cfg.hidden_size, iters=200)
        calls = 2 * cfg.num_hidden_layers + 1
        log("512-token handoff into the tp=3 group")
        handoff = handoff_import_s(single, group)
        group.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)

    emit("tp1.decode_step_s", tp1_decode, "s", threads=args.threads, **context)
    emit("tp3.decode_step_s", tp3_decode, "s", threads_per_rank=1, **context)
    emit("tp1.prefill_512_s", tp1_prefill, "s", threads=args.threads, **context)
    emit("tp3.prefill_512_s", tp3_prefill, "s", threads_per_rank=1, **context)
    emit("tp3.allreduce_call_s", per_call, "s", numel=args.batch * cfg.hidden_size, **context)
    emit("tp3.allreduce_per_step_s", per_call * calls, "s", calls_per_step=calls, **context)
    for name, seconds in handoff.items():
        emit(f"tp3.handoff_512_{name.replace('.', '_s.')}", seconds, "s", **context)
    emit("ratio.decode_step.tp3_over_tp1", tp3_decode / tp1_decode, "ratio", **context)
    emit(
        "ratio.allreduce_over_decode_step.tp3",
        per_call * calls / tp3_decode,
        "ratio",
        **context,
    )


if __name__ == "__main__":
    main()
