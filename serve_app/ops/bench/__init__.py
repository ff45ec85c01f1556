"""`baton bench`: load any OpenAI-compatible endpoint (Baton, vLLM, llama.cpp's server)
and report what clients see.

1. The workload (workload.py): synthetic prompts of --input-len words asking for
   --output-len tokens, or a JSONL file of prompts.
2. For each load point, a concurrency (closed loop) or a Poisson request rate (open
   loop) (load.py), after --warmup requests: streamed completions timed token by
   token over plain HTTP (stream_client.py).
3. Per point: TTFT, time per output token, inter-chunk latency and end-to-end
   percentiles, request and token throughput, goodput under --ttft-slo-ms /
   --tpot-slo-ms, and sent = completed + failed (report.py): JSON lines on stdout, a
   table on stderr, and with --plot a PNG of throughput against latency.

Imports neither torch nor the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from serve_app.ops.bench import load, report, workload
from serve_app.ops.bench.stream_client import Endpoint

__all__ = ["add_bench_args", "bench"]


def _numbers(kind: type, what: str):
    def parse(text: str) -> list:
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what}: comma-separated numbers, got {text!r}"
            ) from None

    return parse


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://localhost:8000/v1", help="the API root")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    load_group = parser.add_mutually_exclusive_group()
    load_group.add_argument(
        "--concurrency",
        type=_numbers(int, "--concurrency"),
        default=None,
        help="requests in flight, one load point each (default 1,4,16)",
    )
    load_group.add_argument(
        "--request-rate",
        type=_numbers(float, "--request-rate"),
        default=None,
        help="Poisson arrivals a second, one load point each",
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per load point")
    parser.add_argument("--input-len", type=int, default=128, help="prompt words (~tokens)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens asked of each")
    parser.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help='JSONL of {"prompt": ..., "max_tokens": N} (max_tokens optional)',
    )
    parser.add_argument("--warmup", type=int, default=2, help="requests sent before each point")
    parser.add_argument("--ttft-slo-ms", type=float, default=None, help="goodput's TTFT target")
    parser.add_argument("--tpot-slo-ms", type=float, default=None, help="goodput's TPOT target")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=None, help="write FILE.png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def bench(args: argparse.Namespace) -> int:
    if args.dataset is not None:
        requests = workload.from_jsonl(args.dataset, args.output_len, args.num_prompts)
    else:
        requests = workload.synthetic(args.num_prompts, args.input_len, args.output_len, args.seed)
    endpoint = Endpoint(args.base_url, args.model, args.api_key, args.timeout_s)
    points = (
        [{"request_rate": r} for r in args.request_rate]
        if args.request_rate
        else [{"concurrency": c} for c in args.concurrency or [1, 4, 16]]
    )
    warmup = workload.synthetic(max(args.warmup, 1), 8, 4, args.seed + 1)[: args.warmup]
    rows = []
    for point in points:
        for request in warmup:
            endpoint.complete(request)
        label = report.load_label(point)
        progress = load.Progress(label, len(requests), not args.no_progress)
        if "concurrency" in point:
            results, seconds = load.at_concurrency(
                endpoint.complete, requests, point["concurrency"], progress
            )
        else:
            results, seconds = load.at_rate(
                endpoint.complete, requests, point["request_rate"], args.seed, progress
            )
        slo = (
            None if args.ttft_slo_ms is None else args.ttft_slo_ms / 1000,
            None if args.tpot_slo_ms is None else args.tpot_slo_ms / 1000,
        )
        row = {"model": endpoint.model, **report.summarize(results, seconds, point, *slo)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(report.table(rows), file=sys.stderr)
    if args.plot is not None:
        report.plot(rows, args.plot, f"{endpoint.model} at {args.base_url}")
    return 0
