"""serve_app/metrics.py: how the router counts a client request around its choices (what
reaches Ray's metrics endpoint is checked live in test_service_lifecycle.py and
test_service_auth.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import fields, replace

import pytest

from serve_app.metrics import ReplicaMetrics, RouterMetrics
from serve_app.streaming.stream_merge import merge_streams
from workers.engine.outputs import EngineStats, RequestOutput
from workers.engine.sequence import FinishReason
from workers.errors import EngineOverloadedError


class CountedRequests(RouterMetrics):
    """The router's metrics, with each request's count also kept here to read back."""

    def __init__(self) -> None:
        super().__init__("test", "tiny")
        self.requests_ended: list[tuple] = []
        self.ttfts: list[float] = []

    def ended(self, api, status, finish_reason="none", prompt_tokens=0):
        self.requests_ended.append((api, status, finish_reason, prompt_tokens))
        super().ended(api, status, finish_reason, prompt_tokens)

    def first_token(self, api, seconds):
        self.ttfts.append(seconds)
        super().first_token(api, seconds)


async def _choice(tokens: int, delay: float = 0.0, fail: Exception | None = None):
    for i in range(tokens):
        await asyncio.sleep(delay)
        done = i == tokens - 1 and fail is None
        finish = FinishReason.LENGTH if done else None
        yield RequestOutput(
            "r",
            [i],
            "x",
            finished=done,
            finish_reason=finish,
            num_prompt_tokens=5,
            num_output_tokens=i + 1,
        )
    if fail is not None:
        raise fail


def _run(metrics: CountedRequests, *choices) -> list:
    async def consume():
        counted = metrics.request("http", time.perf_counter(), merge_streams(list(choices)))
        return [pair async for pair in counted]

    return asyncio.run(consume())


def test_a_request_with_three_choices_counts_once_with_its_prompt_once():
    metrics = CountedRequests()
    pairs = _run(metrics, _choice(3), _choice(3), _choice(3))
    assert len(pairs) == 9
    assert metrics.requests_ended == [("http", "ok", "length", 5)]
    assert len(metrics.ttfts) == 1


def test_a_failing_later_choice_fails_the_request_as_the_client_saw_it():
    metrics = CountedRequests()
    with pytest.raises(EngineOverloadedError):
        _run(metrics, _choice(3, delay=0.01), _choice(1, fail=EngineOverloadedError("full")))
    assert [(api, status) for api, status, *_ in metrics.requests_ended] == [("http", "overloaded")]


def test_time_to_first_token_is_the_first_token_of_any_choice():
    metrics = CountedRequests()
    first_seen = asyncio.Event()

    async def slow_choice():
        await first_seen.wait()  # its token comes only after the client saw the other's
        async for output in _choice(1):
            yield output

    async def consume() -> list[int]:
        counted = metrics.request(
            "http", time.perf_counter(), merge_streams([slow_choice(), _choice(1)])
        )
        ttfts_at_each_pair = []
        async for _ in counted:
            ttfts_at_each_pair.append(len(metrics.ttfts))
            first_seen.set()
        return ttfts_at_each_pair

    # Counted when the fast choice's token reached the client, once.
    assert asyncio.run(consume()) == [1, 1]


def test_a_replicas_counters_grow_by_what_each_report_adds():
    metrics = ReplicaMetrics("app", "decode", "r1", "tiny")
    added: dict[str, list[int]] = {"queries": [], "hits": [], "preemptions": []}
    for name in added:
        counter = getattr(metrics, name if name == "preemptions" else f"prefix_{name}")
        counter.inc = lambda n, tags, name=name: added[name].append((n, tags["model_name"]))
    counts = [(0, 0, 0), (32, 16, 0), (32, 16, 2), (48, 16, 2)]
    for queries, hits, preemptions in counts:
        stats = EngineStats(**{f.name: 0 for f in fields(EngineStats)})
        stats = replace(
            stats,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
        )
        metrics.engine(stats)
    assert added == {
        "queries": [(32, "tiny"), (16, "tiny")],
        "hits": [(16, "tiny")],
        "preemptions": [(2, "tiny")],
    }


def test_a_completed_request_records_vllms_per_request_series_and_a_failed_one_none():
    metrics = CountedRequests()
    seen: list[tuple] = []
    metrics.e2e.observe = lambda v, tags: seen.append(("e2e", tags["model_name"]))
    metrics.request_prompt_tokens.observe = lambda v, tags: seen.append(("prompt", v))
    metrics.request_generation_tokens.observe = lambda v, tags: seen.append(("output", v))
    metrics.success.inc = lambda n, tags: seen.append(("success", tags["finished_reason"]))
    _run(metrics, _choice(3), _choice(2))  # n=2: the outputs of both choices count
    assert seen == [("e2e", "tiny"), ("prompt", 5), ("output", 5), ("success", "length")]
    seen.clear()
    with pytest.raises(EngineOverloadedError):
        _run(metrics, _choice(2, fail=EngineOverloadedError("full")))
    assert seen == []


def test_series_lists_every_series_recorded_by_its_kind():
    from ray.util.metrics import Counter, Gauge, Histogram

    from serve_app.metrics import SERIES

    kinds = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}
    owners = (RouterMetrics("a", "m"), ReplicaMetrics("a", "decode", "r", "m"))
    attributes = [v for owner in owners for v in vars(owner).values()]
    metrics = [m for a in attributes for m in (a.values() if isinstance(a, dict) else [a])]
    recorded = {m._name: kinds[type(m)] for m in metrics if type(m) in kinds}
    assert recorded == SERIES


def test_a_requests_time_in_an_engine_is_recorded_per_part():
    from workers.engine import RequestTiming

    metrics = ReplicaMetrics("app", "prefill", "r1", "tiny")
    seen = {}
    for part, histogram in metrics.request_times.items():
        histogram.observe = lambda v, tags, part=part: seen.setdefault(part, (v, tags["pool"]))
    metrics.timing(RequestTiming(queued_s=0.5, prefill_s=0.25, decode_s=2.0))
    assert seen == {
        "queue": (0.5, "prefill"),
        "prefill": (0.25, "prefill"),
        "decode": (2.0, "prefill"),
        "inference": (2.25, "prefill"),
    }
