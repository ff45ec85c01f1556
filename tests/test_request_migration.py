"""Replica failures in the disaggregated service: kill -9 of a decode replica's process
while 8 streams decode, with a second decode replica to migrate to (router.py's
migration); kill -9 of the prefill replica's, and the degraded mode that follows (decode
prefills new requests itself). Real Ray and Serve, the real SmolLM2, prefill TP 1 -> two
decode replicas."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest
import ray
from ray import serve
from service_helpers import KV, wait_for

from serve_app.config import AppConfig, PoolConfig
from serve_app.ops import service_ops
from serve_app.ops.client import BatonClient, generate_request
from serve_app.ops.status_text import status_lines
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

APP = "migrating"
BOARD = "baton-status-migrating"
MAX_NEW = 120
TEXTS = [f"Story {i}: the lighthouse keeper" for i in range(8)]


def _pids(deployment: str) -> dict[str, int]:
    """Each live replica process of a deployment, by its Serve replica's unique id."""
    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    return {
        a["Name"].removeprefix(prefix): a["Pid"]
        for a in ray._private.state.actors().values()  # the GCS's actor table
        if a["State"] == "ALIVE" and a["Name"].startswith(prefix)
    }


def _snapshots() -> list[dict]:
    from serve_app.status_board import find_board

    return ray.get(find_board(BOARD).snapshots.remote(5.0))


@pytest.fixture(scope="module")
def expected(smollm2_dir) -> list[list[int]]:
    """Each text's greedy tokens from an undisturbed engine."""
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), kv_cache_bytes=KV))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    return [s.output_token_ids for s in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def client(ray_cluster, smollm2_dir, serve_ports):
    config = AppConfig(
        model=str(smollm2_dir),
        mode="disaggregated",
        transport="object_store",
        prefill=PoolConfig(kv_cache_bytes=KV),
        decode=PoolConfig(kv_cache_bytes=KV, num_replicas=2),
        status_board_name=BOARD,
    )
    service_ops.deploy(config, app_name=APP, route_prefix=f"/{APP}", **serve_ports)
    try:
        with BatonClient(f"127.0.0.1:{serve_ports['grpc_port']}", application=APP) as client:
            yield client
    finally:
        serve.delete(APP)
        serve.shutdown()


class _Streams:
    """The 8 texts streamed greedily at once, each on a thread: its tokens and its longest
    gap between two messages."""

    def __init__(self, client: BatonClient) -> None:
        self.got: dict[int, list[int]] = {}
        self.gaps: dict[int, float] = {}
        self.started = threading.Barrier(len(TEXTS) + 1)
        self.client = client
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(TEXTS))]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        request = generate_request(TEXTS[i], max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        tokens, last, gap = [], None, 0.0
        for j, response in enumerate(self.client.generate(request, timeout=300)):
            now = time.monotonic()
            if last is not None:
                gap = max(gap, now - last)
            last = now
            tokens += response.token_ids
            if j == 0:
                self.started.wait()
        self.got[i], self.gaps[i] = tokens, gap

    def results(self) -> list[list[int] | None]:
        for t in self.threads:
            t.join(timeout=300)
        return [self.got.get(i) for i in range(len(TEXTS))]


def _all_blocks_back() -> None:
    wait_for(
        lambda: all(
            e["num_free_blocks"] == e["num_total_blocks"] and not e["num_running"]
            for e in (s["engine"] for s in _snapshots())
        ),
        "every engine's blocks back",
    )


def test_killing_a_decode_replica_loses_no_stream_and_changes_no_token(client, expected):
    wait_for(lambda: len(_pids("DecodeServer")) == 2, "both decode replicas")
    streams = _Streams(client)
    streams.started.wait(timeout=120)  # every stream has its first token
    # The decode replica running the most streams (Serve spreads them over both).
    pids = _pids("DecodeServer")

    def running() -> dict[str, int]:
        return {s["replica_id"]: s["engine"]["num_running"] for s in _snapshots()}

    # The board hears each replica's numbers every second or so.
    wait_for(lambda: any(running().get(r) for r in pids), "streams on a decode replica", poll_s=0.1)
    counts = running()
    victim = max(pids, key=lambda r: counts.get(r, 0))
    os.kill(pids[victim], signal.SIGKILL)
    assert streams.results() == expected
    # The survivor took the lost streams at once, without waiting for Serve's
    # replacement of the dead one.
    assert max(streams.gaps.values()) < 5.0, streams.gaps
    _all_blocks_back()


def test_killing_the_prefill_replica_loses_nothing_and_decode_serves_degraded_meanwhile(
    client, expected, serve_ports
):
    wait_for(lambda: len(_pids("DecodeServer")) == 2, "both decode replicas back")
    (pid,) = _pids("PrefillServer").values()
    streams = _Streams(client)
    os.kill(pid, signal.SIGKILL)  # while the 8 prompts are at prefill or just past it
    # Short requests, one after another, while Serve replaces the prefill replica.
    probe = generate_request(TEXTS[0], max_tokens=8, temperature=0.0, ignore_eos=True)
    probed: list[list[int]] = []
    done = threading.Event()

    def send() -> None:
        while not done.is_set():
            probed.append(list(client.generate_unary(probe, timeout=120).token_ids))

    sender = threading.Thread(target=send)
    sender.start()

    # Until the replacement runs, each decode replica prefills new prompts itself, and
    # says so: on the status board, in `baton status`, in /health.
    def degraded() -> list[dict]:
        return [s for s in _snapshots() if s["handoff"].get("prefill_pool_down")]

    health = f"http://127.0.0.1:{serve_ports['http_port']}/{APP}/health"
    said: set[str] = set()
    wait_for(degraded, "a decode replica in degraded mode", poll_s=0.1)
    while degraded():
        with urllib.request.urlopen(health) as response:
            said.add(json.loads(response.read())["status"])
        lines = status_lines(service_ops.status(APP, BOARD))
        if any(line.strip().startswith("degraded: no prefill replica") for line in lines):
            said.add("baton status: degraded")
    done.set()
    sender.join(timeout=120)
    streams.started.wait(timeout=120)
    assert streams.results() == expected
    assert probed and all(tokens == expected[0][:8] for tokens in probed)
    assert {"degraded", "baton status: degraded"} <= said, said
    wait_for(  # the board hears of it within a second or so
        lambda: sum(s["handoff"].get("num_degraded_prefills", 0) for s in _snapshots()),
        "a prompt prefilled in degraded mode",
        timeout_s=15,
    )
    # The replacement runs: prompts are handed off again.
    handoffs = sum(s["handoff"]["num_handoffs"] for s in _snapshots())
    assert list(client.generate_unary(probe).token_ids) == expected[0][:8]
    wait_for(
        lambda: sum(s["handoff"]["num_handoffs"] for s in _snapshots()) > handoffs,
        "a handoff after the prefill pool came back",
    )
    _all_blocks_back()
