"""What the service tests share: the requests they send, and what they read back from the
running service (the status board, a pool's stats, Ray's Prometheus endpoint)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request

import ray
from no_torch import run_without_torch
from ray import serve

from serve_app.grpc.api import baton_pb2 as pb
from serve_app.model_frontend import ModelFrontend, PromptInput
from serve_app.ops.client import generate_request
from serve_app.routing.registry_names import REGISTRY_NAMESPACE, app_registry_name
from serve_app.status_board import DEFAULT_BOARD_NAME, get_or_create_board
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import model_identity

KV = 48 * 2**20  # per engine: room for the module's requests, small enough for 9 processes
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "1, 1, 2, 3, 5, 8,",
]
MAX_TOKENS = 24


def _leftovers() -> list[str]:
    from ray.util import placement_group_table

    groups = placement_group_table().values()
    return [f"placement group {g['bundles']}" for g in groups if g["state"] != "REMOVED"]


def _joining_env() -> dict[str, str]:
    """This process's environment, with RAY_ADDRESS naming its Ray cluster."""
    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


def baton(*args: str) -> subprocess.CompletedProcess:
    """The `baton` command as an operator runs it, joining this process's Ray cluster."""
    return subprocess.run(
        [sys.executable, "-m", "serve_app.ops.cli", *args],
        env=_joining_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def baton_without_torch(*args: str) -> subprocess.CompletedProcess:
    """`baton(*args)` in a process that cannot import torch: the client commands must not
    need the engine's code where they run."""
    program = f"from serve_app.ops.cli import main\nsys.exit(main({list(args)!r}))\n"
    return run_without_torch(program, env=_joining_env(), timeout=600)


def wait_for(predicate, what: str, timeout_s: float = 180.0, poll_s: float = 0.5):
    """`predicate()`'s first truthy value, polled; AssertionError naming `what` after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)
    return found


def _greedy(prompt, max_tokens=MAX_TOKENS, **kw) -> pb.GenerateRequest:
    return generate_request(prompt, max_tokens=max_tokens, temperature=0.0, **kw)


def _snapshots() -> list[dict]:
    return ray.get(get_or_create_board(DEFAULT_BOARD_NAME).snapshots.remote(5.0))


def _wait_all_blocks_free(timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        snaps = _snapshots()
        busy = [
            s
            for s in snaps
            if s["engine"]["num_free_blocks"] != s["engine"]["num_total_blocks"]
            or s["engine"]["num_running"]
            or s["engine"]["handoffs_held"]
        ]
        if snaps and not busy:
            return snaps
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use after {timeout_s}s: {busy or snaps}")
        time.sleep(0.5)


def _generated(snaps: list[dict]) -> dict[str, int]:
    return {s["replica_id"]: s["engine"]["num_generated_tokens"] for s in snaps}


def _wait_idle(timeout_s: float = 60.0) -> list[dict]:
    """Snapshots once every pool's blocks are free and no replica has generated a token
    over the last few posts. Free blocks alone prove little just after a request was
    sent or cancelled: the snapshot read may predate it."""
    deadline = time.monotonic() + timeout_s
    snaps = _wait_all_blocks_free(timeout_s)
    while True:
        time.sleep(2.5)  # replicas post about once a second
        seen, snaps = _generated(snaps), _wait_all_blocks_free(timeout_s)
        if _generated(snaps) == seen:
            return snaps
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas still generating after {timeout_s}s: {snaps}")


def _decode_stats(app: str = "disagg") -> dict:
    handle = serve.get_deployment_handle("DecodeServer", app_name=app)
    return handle.stats.remote().result()


def _wait_prefill_exports_freed(app: str = "disagg", timeout_s: float = 10.0) -> None:
    handle = serve.get_deployment_handle("PrefillServer", app_name=app)
    deadline = time.monotonic() + timeout_s
    while (held := handle.live_kv_exports.remote().result()) != (0, 0):
        if time.monotonic() > deadline:
            raise AssertionError(f"prefill still holds {held} exported (slices, bytes)")
        time.sleep(0.1)


def _scrape(port: int) -> dict[str, list[tuple[str, float]]]:
    """Prometheus text from Ray's metrics endpoint: metric name -> [(labels, value)]."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{.*\})?\s+(\S+)", line)
        if m and not line.startswith("#"):
            samples.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    return samples


def _holds(registry, hashes) -> bool:
    """Whether the registry names a replica holding all these blocks (it lists every
    replica it knows, those holding none with 0)."""
    return len(hashes) in ray.get(registry.longest_prefixes.remote(hashes)).values()


def _wait_until_known(registry, hashes, failure: str) -> None:
    deadline = time.monotonic() + 30
    while not _holds(registry, hashes):
        assert time.monotonic() < deadline, failure
        time.sleep(0.2)


def _registry(app: str = "disagg"):
    """The application's own prefix registry (conftest's applications name none)."""
    return ray.get_actor(app_registry_name(app), namespace=REGISTRY_NAMESPACE)


def _cached_prompt_hashes(disagg, model_dir, text: str) -> list:
    """The block hashes of a prompt the replicas have just cached, once the registry holds
    them."""
    disagg.generate_unary(_greedy(text, max_tokens=2))
    frontend = ModelFrontend(model_dir, model_identity(model_dir), 16, 1088)
    ids = frontend.tokenize(PromptInput(text=text))
    hashes = frontend.build_request("q", ids, SamplingParams(max_tokens=1), None).block_hashes
    _wait_until_known(_registry(), hashes, "the registry never heard of a cached prompt")
    return hashes
