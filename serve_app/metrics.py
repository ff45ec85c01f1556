"""Baton's Prometheus metrics, recorded through Ray's metrics API.

Ray exports them on every node's metrics endpoint (the one Prometheus already scrapes
for Ray), with Ray's `ray_` prefix. What every inference server measures carries vLLM's
names, as Ray Serve LLM exports them (vLLM's `vllm:` written `vllm_`, since Ray refuses
`:`), and a `model_name` label, so the dashboards built for them read Baton unchanged:
`vllm_time_to_first_token_seconds` is scraped as `ray_vllm_time_to_first_token_seconds`.
What is Baton's own (requests by Baton's statuses, the KV handoff, local prefills,
recomputed prompts, speculation, GPUs) is `baton_*` beside them.

The router records what clients see (TTFT, inter-token and end-to-end latency, each
request's prompt and output tokens); engine replicas record their pool's state
(running/waiting requests, KV usage, prefix-cache queries and hits, preemptions), the
KV handoff (bytes, seconds), the prompts decode prefilled itself by choice and the
prompt tokens recomputed because a handoff failed. `SERIES` lists every series by the
name Ray is given and its kind (tests check the dashboard against it).
Ray exports a counter from its first increment: until a handoff fails, the recompute
series is absent, which Prometheus reads as zero.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from ray.util.metrics import Counter, Gauge, Histogram

from serve_app.errors import public_error
from serve_app.gpu_telemetry import GpuReport
from workers.engine import EngineStats, RequestOutput, RequestTiming

_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
_E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0]
_ITL_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000]

# name given to Ray -> kind: every series this module records.
SERIES = {
    "vllm_time_to_first_token_seconds": "histogram",
    "vllm_inter_token_latency_seconds": "histogram",
    "vllm_e2e_request_latency_seconds": "histogram",
    "vllm_request_prompt_tokens": "histogram",
    "vllm_request_generation_tokens": "histogram",
    "vllm_request_success_total": "counter",
    "vllm_prompt_tokens_total": "counter",
    "vllm_generation_tokens_total": "counter",
    "baton_requests_total": "counter",
    "vllm_num_requests_running": "gauge",
    "vllm_num_requests_waiting": "gauge",
    "vllm_kv_cache_usage_perc": "gauge",
    "vllm_prefix_cache_queries_total": "counter",
    "vllm_prefix_cache_hits_total": "counter",
    "vllm_num_preemptions_total": "counter",
    "vllm_request_queue_time_seconds": "histogram",
    "vllm_request_prefill_time_seconds": "histogram",
    "vllm_request_decode_time_seconds": "histogram",
    "vllm_request_inference_time_seconds": "histogram",
    "baton_speculative_acceptance_ratio": "gauge",
    "baton_kv_handoff_bytes_total": "counter",
    "baton_kv_handoff_seconds": "histogram",
    "baton_handoff_recomputed_prompt_tokens_total": "counter",
    "baton_local_prefills_total": "counter",
    "baton_degraded_prefills_total": "counter",
    "baton_degraded_mode": "gauge",
    "baton_request_migrations_total": "counter",
    "baton_gpu_memory_used_bytes": "gauge",
    "baton_gpu_memory_total_bytes": "gauge",
    "baton_gpu_utilization_ratio": "gauge",
}


class RouterMetrics:
    def __init__(self, app: str, model_name: str):
        self._tags = {"app": app, "model_name": model_name}
        keys = ("model_name", "app", "api")
        self.ttft = Histogram(
            "vllm_time_to_first_token_seconds",
            "Seconds from a request's arrival at the router to its first token.",
            _LATENCY_BUCKETS,
            keys,
        )
        self.itl = Histogram(
            "vllm_inter_token_latency_seconds",
            "Seconds between consecutive tokens of one stream.",
            _ITL_BUCKETS,
            keys,
        )
        self.e2e = Histogram(
            "vllm_e2e_request_latency_seconds",
            "Seconds from a request's arrival at the router to its end (completed ones).",
            _E2E_BUCKETS,
            keys,
        )
        self.request_prompt_tokens = Histogram(
            "vllm_request_prompt_tokens",
            "Prompt tokens of each completed request.",
            _TOKEN_BUCKETS,
            keys,
        )
        self.request_generation_tokens = Histogram(
            "vllm_request_generation_tokens",
            "Tokens generated for each completed request.",
            _TOKEN_BUCKETS,
            keys,
        )
        self.success = Counter(
            "vllm_request_success_total",
            "Requests completed, by finished_reason (stop, length, abort).",
            (*keys, "finished_reason"),
        )
        self.requests = Counter(
            "baton_requests_total",
            "Requests ended, by finish reason (stop, length, abort, none; with n choices, "
            "the first choice's) and status (ok, invalid, unauthenticated, overloaded, "
            "unavailable, cancelled, internal).",
            ("model_name", "app", "api", "finish_reason", "status"),
        )
        self.prompt_tokens = Counter("vllm_prompt_tokens_total", "Prompt tokens served.", keys)
        self.generation_tokens = Counter("vllm_generation_tokens_total", "Tokens generated.", keys)
        self.migrations = Counter(
            "baton_request_migrations_total",
            "Requests sent again to the pool after the replica serving them failed.",
            keys,
        )

    def first_token(self, api: str, seconds: float) -> None:
        self.ttft.observe(seconds, {**self._tags, "api": api})

    def next_tokens(self, api: str, seconds: float, num_tokens: int) -> None:
        tags = {**self._tags, "api": api}
        for _ in range(num_tokens):  # outputs may carry several tokens: spread the gap
            self.itl.observe(seconds / num_tokens, tags)

    def ended(
        self, api: str, status: str, finish_reason: str = "none", prompt_tokens: int = 0
    ) -> None:
        tags = {**self._tags, "api": api}
        self.requests.inc(1, {**tags, "finish_reason": finish_reason, "status": status})
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens, tags)

    def completed(
        self, api: str, seconds: float, finish_reason: str, prompt_tokens: int, output_tokens: int
    ) -> None:
        """A request that ended well: its latency and token counts, as vLLM counts them."""
        tags = {**self._tags, "api": api}
        self.e2e.observe(seconds, tags)
        self.request_prompt_tokens.observe(prompt_tokens, tags)
        self.request_generation_tokens.observe(output_tokens, tags)
        self.success.inc(1, {**tags, "finished_reason": finish_reason})

    def migrated(self, api: str) -> None:
        self.migrations.inc(1, {**self._tags, "api": api})

    def generated(self, api: str, num_tokens: int) -> None:
        """The tokens one choice of a request generated."""
        if num_tokens:
            self.generation_tokens.inc(num_tokens, {**self._tags, "api": api})

    async def request(
        self, api: str, started: float, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Passes a client request's (choice index, output) pairs through and counts the
        request once, whatever its number of choices: time to first token at the first
        token of any choice, the status that ended it as the client saw it (a failing
        choice fails the request), choice 0's finish reason, and the prompt."""
        status, lasts = "internal", {}
        try:
            async for index, out in outputs:
                if not lasts:
                    self.first_token(api, time.perf_counter() - started)
                lasts[index] = out
                yield index, out
            status = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        except Exception as e:
            status = public_error(e)[0]
            raise
        finally:
            last = lasts.get(0) or next(iter(lasts.values()), None)
            finish = last.finish_reason.value if last and last.finish_reason else "none"
            prompt = last.num_prompt_tokens if last else 0
            self.ended(api, status, finish, prompt)
            if status == "ok" and last is not None:
                output = sum(out.num_output_tokens for out in lasts.values())
                self.completed(api, time.perf_counter() - started, finish, prompt, output)


class ReplicaMetrics:
    def __init__(self, app: str, pool: str, replica_id: str, model_name: str):
        # `engine` as vLLM labels an engine's series; here the Serve replica.
        self._tags = {"model_name": model_name, "app": app, "pool": pool, "engine": replica_id}
        keys = ("model_name", "app", "pool", "engine")
        self.running = Gauge("vllm_num_requests_running", "Requests being computed.", keys)
        self.waiting = Gauge(
            "vllm_num_requests_waiting", "Requests waiting for a slot or for KV blocks.", keys
        )
        self.kv_usage = Gauge(
            "vllm_kv_cache_usage_perc", "Fraction of the KV-cache blocks in use (0-1).", keys
        )
        # A hit rate over a window, and across replicas, is these counters' rates' ratio.
        self.prefix_queries = Counter(
            "vllm_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", keys
        )
        self.prefix_hits = Counter(
            "vllm_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", keys
        )
        self.preemptions = Counter(
            "vllm_num_preemptions_total", "Running requests preempted for KV blocks.", keys
        )
        # (queries, hits, preemptions) of the engine's totals already added to the counters.
        self._counted = (0, 0, 0)
        # Each request's time in this pool's engine (a P/D request has a prefill and a
        # decode part, one per pool: `pool` tells them apart).
        self.request_times = {
            part: Histogram(
                f"vllm_request_{part}_time_seconds",
                f"Seconds of a request's {what} in this engine.",
                _E2E_BUCKETS,
                keys,
            )
            for part, what in (
                ("queue", "wait to be scheduled"),
                ("prefill", "time from being scheduled to its first token"),
                ("decode", "time from its first token to its end"),
                ("inference", "prefill and decode time"),
            )
        }
        self.draft_acceptance = Gauge(
            "baton_speculative_acceptance_ratio",
            "Drafted tokens the model agreed with, of those checked (speculative decoding).",
            keys,
        )
        self.handoff_bytes = Counter(
            "baton_kv_handoff_bytes_total", "KV-cache bytes received from prefill.", keys
        )
        self.handoff_seconds = Histogram(
            "baton_kv_handoff_seconds",
            "Time a KV handoff added to a request: export, transfer and import.",
            _LATENCY_BUCKETS,
            keys,
        )
        self.recomputed = Counter(
            "baton_handoff_recomputed_prompt_tokens_total",
            "Prompt tokens computed again because a KV handoff failed.",
            keys,
        )
        self.local_prefills = Counter(
            "baton_local_prefills_total",
            "Prompts a decode replica prefilled itself (selective disaggregation or "
            "degraded mode).",
            keys,
        )
        self.degraded_prefills = Counter(
            "baton_degraded_prefills_total",
            "Prompts a decode replica prefilled itself because the prefill pool had no "
            "running replica.",
            keys,
        )
        self.prefill_pool_down = Gauge(
            "baton_degraded_mode",
            "1 while this decode replica sees no running prefill replica and prefills new "
            "requests itself (degraded mode), else 0.",
            keys,
        )
        self.gpu_memory_used = Gauge(
            "baton_gpu_memory_used_bytes", "GPU memory in use.", (*keys, "device")
        )
        self.gpu_memory_total = Gauge(
            "baton_gpu_memory_total_bytes", "GPU memory in all.", (*keys, "device")
        )
        self.gpu_utilization = Gauge(
            "baton_gpu_utilization_ratio", "GPU busy fraction (NVML).", (*keys, "device")
        )

    def engine(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running, self._tags)
        self.waiting.set(stats.num_waiting + stats.imports_waiting, self._tags)
        used = stats.num_total_blocks - stats.num_free_blocks
        self.kv_usage.set(used / max(stats.num_total_blocks, 1), self._tags)
        totals = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)
        counters = (self.prefix_queries, self.prefix_hits, self.preemptions)
        for counter, total, counted in zip(counters, totals, self._counted, strict=True):
            if total > counted:  # Ray's Counter refuses inc(0)
                counter.inc(total - counted, self._tags)
        self._counted = totals
        if stats.num_draft_tokens:  # a replica that never speculated exports no ratio
            ratio = stats.num_accepted_draft_tokens / stats.num_draft_tokens
            self.draft_acceptance.set(ratio, self._tags)

    def timing(self, timing: RequestTiming) -> None:
        """A request that ended in this engine (or handed off, on prefill)."""
        for part, seconds in (
            ("queue", timing.queued_s),
            ("prefill", timing.prefill_s),
            ("decode", timing.decode_s),
            ("inference", timing.inference_s),
        ):
            self.request_times[part].observe(seconds, self._tags)

    def handoff(self, num_bytes: int, seconds: float) -> None:
        if num_bytes:  # none when decode held every block; Ray's Counter refuses inc(0)
            self.handoff_bytes.inc(num_bytes, self._tags)
        self.handoff_seconds.observe(seconds, self._tags)

    def recompute(self, num_tokens: int) -> None:
        self.recomputed.inc(num_tokens, self._tags)

    def local_prefill(self, degraded: bool = False) -> None:
        self.local_prefills.inc(1, self._tags)
        if degraded:
            self.degraded_prefills.inc(1, self._tags)

    def degraded(self, down: bool) -> None:
        self.prefill_pool_down.set(float(down), self._tags)

    def gpus(self, report: GpuReport) -> None:
        for d in report.devices:
            tags = {**self._tags, "device": str(d.index)}
            self.gpu_memory_used.set(d.memory_used_bytes, tags)
            self.gpu_memory_total.set(d.memory_total_bytes, tags)
            if d.utilization is not None:
                self.gpu_utilization.set(d.utilization, tags)
