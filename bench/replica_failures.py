"""Requests lost to replica failures: the disaggregated service (one prefill, two decode
replicas and two routers, the bundled model) takes 200 streamed completions at 16
concurrent through its OpenAI HTTP ingress, once undisturbed and once while a replica of
`--kill` (decode by default, router or prefill) is killed (kill -9 of its process) every
20 s.

Prints, per run: requests lost (failed or cut after the client's retries; the target is
0), the attempts that failed and were retried (`failed_attempts`: a router's death costs
the calls it was answering a retryable error, which clients retry, as the openai SDK
does twice by default), the p99 over requests of each one's longest gap between two
streamed chunks (`max_gap_p99_s`; the first token's wait counts as a gap too, so a
request queued behind a kill shows), output tokens/s, and
`ratio.throughput_killed_over_undisturbed`. Both runs share one deployment and follow
each other, so the ratio compares like with like.

    .venv/bin/python bench/replica_failures.py [--kill decode|router|prefill]
        [--requests 200] [--concurrency 16] [--kill-every-s 20] [--output-len 64]
        [--input-len 32] [--client-retries 2] [--threads auto]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import tempfile
import threading
import time

import ray
from common import emit, git_commit, log
from ray import serve

from serve_app.config import AppConfig, PoolConfig, RouterConfig
from serve_app.ops import service_ops
from serve_app.ops.bench.load import Progress, at_concurrency
from serve_app.ops.bench.stream_client import Endpoint, RequestResult
from serve_app.ops.bench.workload import synthetic

APP = "failures"
KV = 64 * 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEPLOYMENTS = {"decode": "DecodeServer", "prefill": "PrefillServer", "router": "Router"}
# Replicas each pool runs: a killed one's requests have a second to go to.
REPLICAS = {"decode": 2, "prefill": 1, "router": 2}


def _pids(pool: str) -> list[int]:
    prefix = f"SERVE_REPLICA::{APP}#{DEPLOYMENTS[pool]}#"
    return [
        a["Pid"]
        for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and a["Name"].startswith(prefix)
    ]


class Killer:
    """Kills one live replica of `pool` every `every_s` seconds until stopped."""

    def __init__(self, pool: str, every_s: float) -> None:
        self.pool, self.every_s, self.kills = pool, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            pids = _pids(self.pool)
            if pids:
                victim = pids[self.kills % len(pids)]
                os.kill(victim, signal.SIGKILL)
                self.kills += 1
                log(f"killed {self.pool} replica pid {victim}")


class Retrying:
    """`endpoint.complete` with a client's retries of a failed attempt (a 503, a refused
    or cut connection), after 0.5 s, 1 s, ...; counts the attempts that failed."""

    def __init__(self, endpoint: Endpoint, retries: int) -> None:
        self.endpoint, self.retries = endpoint, retries
        self.failed_attempts = 0
        self._lock = threading.Lock()

    def __call__(self, request) -> RequestResult:
        result = self.endpoint.complete(request)
        for attempt in range(self.retries):
            if result.ok:
                break
            with self._lock:
                self.failed_attempts += 1
            log(f"retrying after: {result.error[:120]}")
            time.sleep(0.5 * 2**attempt)
            result = self.endpoint.complete(request)
        return result


def _longest_gap(r: RequestResult) -> float:
    return max([r.ttft or 0.0, *r.itl])


def _figures(results: list[RequestResult], seconds: float, retried: int) -> dict[str, float]:
    gaps = sorted(_longest_gap(r) for r in results if r.ok)
    p99 = gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))] if gaps else float("nan")
    return {
        "lost": sum(not r.ok for r in results),
        "failed_attempts": retried,
        "max_gap_p99_s": p99,
        "max_gap_max_s": gaps[-1] if gaps else float("nan"),
        "tokens_per_s": sum(r.output_tokens for r in results if r.ok) / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kill-every-s", type=float, default=20.0)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--kill", choices=sorted(DEPLOYMENTS), default="decode")
    parser.add_argument("--client-retries", type=int, default=2)
    parser.add_argument("--threads", default="auto", help="each replica's: auto or a number")
    args = parser.parse_args()
    threads = args.threads if args.threads == "auto" else int(args.threads)
    ray.init(
        address="local",
        num_cpus=16,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="rayfail", dir="/tmp"),
    )
    ports = {"http_port": _free_port(), "grpc_port": _free_port(), "http_host": "127.0.0.1"}
    config = AppConfig(
        mode="disaggregated",
        transport="object_store",
        enable_prefix_caching=False,  # both runs send the same prompts
        prefill=PoolConfig(kv_cache_bytes=KV, num_threads=threads),
        decode=PoolConfig(kv_cache_bytes=KV, num_replicas=REPLICAS["decode"], num_threads=threads),
        router=RouterConfig(num_replicas=REPLICAS["router"]),
    )
    service_ops.deploy(config, app_name=APP, route_prefix=f"/{APP}", **ports)
    context = {
        "commit": git_commit(),
        "concurrency": args.concurrency,
        "killed": args.kill,
        "threads": args.threads,
    }
    try:
        endpoint = Endpoint(f"http://127.0.0.1:{ports['http_port']}/{APP}/v1", None, None, 600)
        requests = synthetic(args.requests, args.input_len, args.output_len, seed=0)
        at_concurrency(endpoint.complete, requests[:16], 8, Progress("warm-up", 16, False))
        runs = {}
        for name in ("undisturbed", "killed"):
            while len(_pids(args.kill)) < REPLICAS[args.kill]:  # a replacement starting
                time.sleep(0.5)
            progress = Progress(name, len(requests), True)
            send = Retrying(endpoint, args.client_retries)
            if name == "killed":
                with Killer(args.kill, args.kill_every_s) as killer:
                    results, seconds = at_concurrency(send, requests, args.concurrency, progress)
                context["kills"] = killer.kills
            else:
                results, seconds = at_concurrency(send, requests, args.concurrency, progress)
            runs[name] = _figures(results, seconds, send.failed_attempts)
            for error in sorted({r.error for r in results if not r.ok})[:5]:
                log(f"{name}: failed: {error}")
            for metric, value in runs[name].items():
                emit(f"replica_failures.{name}.{metric}", value, "", **context)
        ratio = runs["killed"]["tokens_per_s"] / runs["undisturbed"]["tokens_per_s"]
        emit("ratio.throughput_killed_over_undisturbed", ratio, "x", **context)
    finally:
        serve.delete(APP)
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
