"""The service against the in-process engine, in one run: what serving costs.

Runs 8 and 32 concurrent streams of 128 new tokens each, round by round: each service
through Serve's gRPC ingress, each right after the in-process `AsyncEngine`. Prints
aggregate tokens/s, TTFT p50/p99 and inter-token latency p50/p99 per system and
concurrency, the CPU the router and Serve's ingress ("proxy": HAProxy and its manager,
or a Python proxy) spend per streamed message (`*_cpu_ms_per_msg`),
ratio.*.<system>_over_engine, and, per KV transport, the handoff time of a 512-token
prompt next to its prefill time (ratio.handoff_over_prefill_512.<transport>).

A ratio over the engine is the median, over rounds, of a service's tokens/s over the
mean of the in-process engine's measured just before and just after it (the engine runs
between services, so a steady drift of the VM's speed during the run cancels out;
"engine.*" are the medians of all those engine runs).

Each service is deployed for its own turn and deleted after it, so it shares the
machine only with what it brings: an idle replica is not free (Serve's health checks,
metrics and routing stats cost each one a little CPU, bench/RESULTS.md). The
in-process engine runs while no application is deployed.

"agg_actor_call" is "agg" with the router's pool calls as Ray actor calls rather than
Serve's inter-deployment gRPC (AppConfig.output_channel), "agg_python_proxy" is "agg"
behind Serve's Python proxy rather than its HAProxy (the ingress before HAProxy), and
"disagg_selective" is "disagg" with selective disaggregation (decode prefills the prompts
that arrive while it waits on --max-pending-prefills prefills), for comparison.

The services run twice: streaming every token (stream_interval 1, the default: "agg",
"disagg") and every `--stream-interval` tokens after the first ("agg_si<N>",
"disagg_si<N>"), the setting that trades smooth streams for less CPU per token on the
serving path (the router -> client hop, one gRPC message per stream each time; the
engine -> router hop carries one message per engine step whatever the setting).

    .venv/bin/python bench/service.py [--rounds 2] [--model DIR] [--agg-threads 2]
        [--decode-threads 2] [--stream-interval 4] [--max-pending-prefills 4] [--dtype float32]
        [--systems [agg disagg ...]] [--transports [object_store nixl]]

Every engine, in process or in a pool, runs in --dtype (bfloat16: the fast path on CPUs
with AMX or AVX512-BF16); each line carries it as its "dtype" key.

Threads: every engine uses both cores. The in-process engine and the aggregated
replica are the only engine computing; the prefill and decode replicas take turns more
than they overlap (a burst's prompts are prefilled before most of its decoding), and an
idle engine's threads sleep. With one prefill thread (--prefill-threads 1) a burst of
32 prompts waits longer for its first tokens; two make a shorter prefill, and so a
handoff a larger share of it (ratio.handoff_over_prefill_512.*).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import tempfile
import time
import uuid

import grpc
import ray
from common import TOPICS, cpu_count, emit, git_commit, log, median, topic_prompt
from ray import serve
from service_apps import Deployed, app_configs

from serve_app.config import TRANSPORTS, AppConfig
from serve_app.grpc.api import baton_pb2 as pb
from serve_app.grpc.api import baton_pb2_grpc as pb_grpc
from serve_app.ops import node_drain
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams

NEW_TOKENS = 128
PROMPT_TOKENS = 32


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Run:
    """One concurrency run: per-stream token arrival times."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.streams: list[list[float]] = []

    def figures(self) -> dict[str, float]:
        end = max(t[-1] for t in self.streams)
        tokens = sum(len(t) for t in self.streams)
        ttfts = [t[0] - self.start for t in self.streams]
        itls = [b - a for t in self.streams for a, b in zip(t, t[1:], strict=False)]
        return {
            "tok_s": tokens / (end - self.start),
            "ttft_p50": _percentile(ttfts, 0.5),
            "ttft_p99": _percentile(ttfts, 0.99),
            "itl_p50": _percentile(itls, 0.5),
            "itl_p99": _percentile(itls, 0.99),
        }


async def engine_run(engine: AsyncEngine, prompts: list[list[int]]) -> dict[str, float]:
    run = Run()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> None:
        times = []
        async for out in engine.generate(uuid.uuid4().hex, prompt, params):
            times.extend([time.perf_counter()] * len(out.new_token_ids))
        run.streams.append(times)

    await asyncio.gather(*(one(p) for p in prompts))
    return run.figures()


def serving_cpu_s() -> dict[str, float]:
    """CPU seconds used so far by this node's Serve router replicas and Serve's ingress
    ("proxy": HAProxy, the actor that runs it and any Python proxy), from /proc: the
    serving path's own cost, which a throughput figure on a shared, noisy VM hides."""
    raylet = node_drain.raylets()[ray.get_runtime_context().get_node_id()]
    used = {"router": 0.0, "proxy": 0.0}

    def cpu_s(pid: int) -> float:
        fields = node_drain.stat_fields(pid)  # utime + stime, in clock ticks
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0

    for pid in node_drain.serving_processes(raylet):
        command = " ".join(node_drain.cmdline(pid))
        if "ProxyActor" in command:
            used["proxy"] += cpu_s(pid)
        elif "HAProxyManager" in command:  # HAProxy runs as its child
            used["proxy"] += cpu_s(pid) + sum(cpu_s(c) for c in node_drain.children(pid))
        elif ":Router" in command:
            used["router"] += cpu_s(pid)
    return used


async def service_run(address: str, app: str, prompts: list[list[int]]) -> dict[str, float]:
    run = Run()
    messages = 0
    cpu_before = serving_cpu_s()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.BatonStub(channel)

        async def one(prompt: list[int]) -> None:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                max_tokens=NEW_TOKENS,
                temperature=0.0,
                ignore_eos=True,
            )
            times = []
            nonlocal messages
            async for msg in stub.Generate(request, metadata=(("application", app),)):
                times.extend([time.perf_counter()] * len(msg.token_ids))
                messages += 1
            run.streams.append(times)

        await asyncio.gather(*(one(p) for p in prompts))
    cpu_after = serving_cpu_s()
    figures = run.figures()
    for kind, seconds in cpu_after.items():
        figures[f"{kind}_cpu_ms_per_msg"] = (seconds - cpu_before[kind]) * 1e3 / messages
    return figures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def handoff_figures(
    address: str, app: str, prompt: list[int], rounds: int
) -> tuple[float, float]:
    """Median prefill seconds and handoff seconds of single 512-token requests (decode's
    counters around each request; prefix caching is off, so every block travels)."""
    from serve_app.ops.client import BatonClient

    decode = serve.get_deployment_handle("DecodeServer", app_name=app)
    prefills, handoffs = [], []
    with BatonClient(address, application=app) as client:
        for _ in range(rounds + 1):  # the first one warms the path up
            before = (await decode.stats.remote())["handoff"]
            client.generate_unary(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=2, temperature=0.0)
            )
            after = (await decode.stats.remote())["handoff"]
            prefills.append(after["prefill_seconds"] - before["prefill_seconds"])
            handoffs.append(after["seconds"] - before["seconds"])
    return median(prefills[1:]), median(handoffs[1:])


async def main_async(args: argparse.Namespace) -> None:
    model_dir = AppConfig(model=args.model).model_dir()
    threads = min(2, cpu_count())
    ray.init(
        address="local",
        num_cpus=16,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"),
    )
    http_port, grpc_port = _free_port(), _free_port()
    address = f"127.0.0.1:{grpc_port}"
    ports = {"http_port": http_port, "grpc_port": grpc_port, "http_host": "127.0.0.1"}
    apps = app_configs(args)
    si = args.stream_interval

    engine = AsyncEngine.from_config(
        EngineConfig(
            model=str(model_dir),
            # The pools here are CPU pools; "auto" would take a GPU where there is one.
            device="cpu",
            num_threads=threads,
            enable_prefix_caching=False,
            dtype=args.dtype,
        )
    )
    tok = engine.tokenizer
    batches = {c: [topic_prompt(tok, TOPICS[i], PROMPT_TOKENS) for i in range(c)] for c in (8, 32)}
    disagg = f"disagg_{AppConfig().kv_transport()}"  # throughput over the default transport
    services = {"agg": "agg", "disagg": disagg, f"agg_si{si}": f"agg_si{si}"}
    services[f"disagg_si{si}"] = f"{disagg}_si{si}"
    services["agg_actor_call"] = "agg_actor_call"
    services["disagg_selective"] = "disagg_selective"
    services["agg_python_proxy"] = "agg"
    if args.systems is not None:
        unknown = sorted(set(args.systems) - set(services))
        if unknown:
            raise ValueError(f"--systems: {unknown} not among {sorted(services)}")
        services = {system: services[system] for system in args.systems}

    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    # (system, concurrency) -> its tokens/s over the engine's, measured just before it.
    paired: dict[tuple[str, int], list[float]] = {}

    async def measure(system: str, run, warm_up: bool = True) -> dict[int, float]:
        if warm_up:
            await run(batches[8][:2])
        tok_s = {}
        for c, prompts in batches.items():
            figures = await run(prompts)
            results.setdefault((system, c), []).append(figures)
            tok_s[c] = figures["tok_s"]
            log(f"  c{c} {system:10s} {figures['tok_s']:.1f} tok/s")
        return tok_s

    def run_engine(prompts: list[list[int]]):
        return engine_run(engine, prompts)

    await run_engine(batches[8][:2])  # warm-up
    # The engine runs between services, and each service is set against the mean of the
    # runs just before and after it: this VM's speed drifts by 10-30% within minutes, and
    # the bracket cancels a steady drift.
    before = await measure("engine", run_engine, warm_up=False)
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        for system, app in services.items():
            with Deployed(app, apps[app], ports, python_proxy=system == "agg_python_proxy"):
                tok_s = await measure(system, lambda p, app=app: service_run(address, app, p))
            after = await measure("engine", run_engine, warm_up=False)
            for c in batches:
                bracket = (before[c] + after[c]) / 2
                paired.setdefault((system, c), []).append(tok_s[c] / bracket)
            before = after
    await engine.shutdown()

    context = {
        "model": model_dir.name,
        "new_tokens": NEW_TOKENS,
        "engine_threads": threads,
        "agg_threads": args.agg_threads,
        "prefill_threads": args.prefill_threads,
        "decode_threads": args.decode_threads,
        "si_stream_interval": si,
        "selective_max_pending_prefills": args.max_pending_prefills,
        "dtype": args.dtype,
        "git_commit": git_commit(),
    }
    medians: dict[tuple[str, int], dict[str, float]] = {}
    for (system, c), runs in results.items():
        medians[system, c] = {k: median([f[k] for f in runs]) for k in runs[0]}
        for key, value in medians[system, c].items():
            unit = {"tok_s": "tok/s"}.get(key, "ms" if key.endswith("_ms_per_msg") else "s")
            emit(f"{system}.c{c}_{key}", value, unit, concurrency=c, **context)
    for c in batches:
        for system in services:
            ratio = median(paired[system, c])
            emit(f"ratio.c{c}_tok_s.{system}_over_engine", ratio, "ratio", **context)

    long_prompt = topic_prompt(tok, TOPICS[1], 512)
    for transport in args.transports:
        app = f"disagg_{transport}"
        with Deployed(app, apps[app], ports, python_proxy=False):
            prefill_s, handoff_s = await handoff_figures(address, app, long_prompt, 3)
        ctx = {"transport": transport, **context}
        emit(f"disagg.prefill_512_s.{transport}", prefill_s, "s", **ctx)
        emit(f"disagg.handoff_512_s.{transport}", handoff_s, "s", **ctx)
        emit(f"ratio.handoff_over_prefill_512.{transport}", handoff_s / prefill_s, "ratio", **ctx)
    serve.shutdown()
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--model",
        default="default",
        help="a local Hugging Face model folder (default: the bundled SmolLM2-135M-Instruct); "
        "a tiny one shows what the serving path alone can carry",
    )
    parser.add_argument("--agg-threads", type=int, default=min(2, cpu_count()))
    parser.add_argument("--prefill-threads", type=int, default=min(2, cpu_count()))
    parser.add_argument("--decode-threads", type=int, default=min(2, cpu_count()))
    parser.add_argument("--max-pending-prefills", type=int, default=4)
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=4,
        help="the stream_interval of the *_si<N> services (default 4)",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--systems",
        nargs="*",
        metavar="SYSTEM",
        help="measure only these services (e.g. agg disagg; none: only the handoffs)",
    )
    parser.add_argument(
        "--transports",
        nargs="*",
        choices=TRANSPORTS,
        default=list(TRANSPORTS),
        help="the KV transports whose handoff to measure (default all; none: no handoffs)",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Deleting an application waits this long for its router (Serve's direct ingress) to
    # drain, 30 s by default; HAProxy runs beside it here. Ray's processes inherit it.
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
