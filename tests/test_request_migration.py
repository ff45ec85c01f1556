"""Request migration (router.py) in the disaggregated service: kill -9 of a decode
replica's process while 8 streams decode, with a second decode replica to migrate to.
Real Ray and Serve, the real SmolLM2, prefill TP 1 -> two decode replicas."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
from ray import serve
from service_helpers import KV, wait_for

from serve_app.config import AppConfig, PoolConfig
from serve_app.ops import service_ops
from serve_app.ops.client import BatonClient, generate_request
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

APP = "migrating"
BOARD = "baton-status-migrating"
MAX_NEW = 120
TEXTS = [f"Story {i}: the lighthouse keeper" for i in range(8)]


def _decode_pids() -> dict[str, int]:
    """Each live decode replica's process, by its Serve replica's unique id."""
    prefix = f"SERVE_REPLICA::{APP}#DecodeServer#"
    return {
        a["Name"].removeprefix(prefix): a["Pid"]
        for a in ray._private.state.actors().values()  # the GCS's actor table
        if a["State"] == "ALIVE" and a["Name"].startswith(prefix)
    }


def _snapshots() -> list[dict]:
    from serve_app.status_board import find_board

    return ray.get(find_board(BOARD).snapshots.remote(5.0))


def test_killing_a_decode_replica_loses_no_stream_and_changes_no_token(
    ray_cluster, smollm2_dir, serve_ports
):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), kv_cache_bytes=KV))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    expected = [
        s.output_token_ids
        for s in engine.generate([engine.tokenizer.encode(t) for t in TEXTS], params)
    ]
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
            wait_for(lambda: len(_decode_pids()) == 2, "both decode replicas")
            got: dict[int, list[int]] = {}
            gaps: dict[int, float] = {}
            started = threading.Barrier(len(TEXTS) + 1)

            def run(i: int) -> None:
                request = generate_request(
                    TEXTS[i], max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True
                )
                tokens, last, gap = [], None, 0.0
                for j, response in enumerate(client.generate(request, timeout=300)):
                    now = time.monotonic()
                    if last is not None:
                        gap = max(gap, now - last)
                    last = now
                    tokens += response.token_ids
                    if j == 0:
                        started.wait()
                got[i], gaps[i] = tokens, gap

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(TEXTS))]
            for t in threads:
                t.start()
            started.wait(timeout=120)  # every stream has its first token
            # The decode replica running the most streams (Serve spreads them over both).
            pids = _decode_pids()

            def running() -> dict[str, int]:
                snaps = _snapshots()
                return {s["replica_id"]: s["engine"]["num_running"] for s in snaps}

            # The board hears each replica's numbers every second or so.
            wait_for(
                lambda: any(running().get(r) for r in pids),
                "streams on a decode replica",
                poll_s=0.1,
            )
            counts = running()
            victim = max(pids, key=lambda r: counts.get(r, 0))
            os.kill(pids[victim], signal.SIGKILL)
            for t in threads:
                t.join(timeout=300)
            assert [got.get(i) for i in range(len(TEXTS))] == expected
            # The survivor took the lost streams at once, without waiting for Serve's
            # replacement of the dead one.
            assert max(gaps.values()) < 5.0, gaps
            wait_for(
                lambda: all(
                    e["num_free_blocks"] == e["num_total_blocks"] and not e["num_running"]
                    for e in (s["engine"] for s in _snapshots())
                ),
                "every engine's blocks back",
            )
    finally:
        serve.delete(APP)
        serve.shutdown()
