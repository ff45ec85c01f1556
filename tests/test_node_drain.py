"""`baton drain` (serve_app/ops/node_drain.py), the worker pods' preStop hook: on a real Ray
with two extra nodes, draining the node that hosts a pool's replica moves the replica to
the other node while the stream it serves runs to its end."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from ray import serve
from service_helpers import KV, wait_for

from serve_app.config import AppConfig, PoolConfig, RouterConfig
from serve_app.ops import node_drain, service_ops
from serve_app.ops.client import BatonClient, generate_request
from serve_app.serve_config import GRPC_SERVICER_FUNCTIONS

pytestmark = pytest.mark.slow

SLOT = "drain_test_slot"  # only the extra nodes offer it: the pool's replica must go there
# The stream must still run when Serve stops the old replica: here at once, since the
# drain's deadline leaves no more than the pool's graceful-shutdown time (seen ~2 s after
# the drain, the stream lasting ~15 s).
TOKENS = 200


def _add_node(gcs_address: str):
    """A worker node of the session's Ray, as a process tree of its own (what
    ray.cluster_utils does, for a cluster it did not start)."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(
        gcs_address=gcs_address,
        num_cpus=1,
        resources={SLOT: 1},
        object_store_memory=80 * 2**20,
        node_manager_port=0,
        min_worker_port=0,
        max_worker_port=0,
        include_log_monitor=False,
    )
    params.dashboard_agent_listen_port = None  # a free one, not the head agent's
    # Its processes are killed by the fixture, not at the interpreter's exit.
    node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=True)
    deadline = time.monotonic() + 60
    while not any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "the extra Ray node did not join"
        time.sleep(0.2)
    return node


def _replica_hosts() -> list[str]:
    """The node ids whose raylets run a process of the pool's replicas."""
    by_raylet = {pid: node for node, pid in node_drain.raylets().items()}
    return [
        by_raylet[pid]
        for pid in by_raylet
        for process in node_drain.serving_processes(pid)
        if "EngineServer" in " ".join(node_drain.cmdline(process))
    ]


def _replica_node() -> str:
    """The node id whose raylet runs the pool's one replica process."""
    hosts = _replica_hosts()
    assert len(hosts) == 1, hosts
    return hosts[0]


def _watch_replica_states(done: threading.Event, first_seen: dict[str, float]) -> None:
    """When each state of the pool's replicas was first seen (Serve's own view)."""
    while not done.is_set():
        app = serve.status().applications.get("drain")
        if app is not None:
            for state in app.deployments["EngineServer"].replica_states:
                first_seen.setdefault(state, time.monotonic())
        time.sleep(0.1)


@pytest.fixture(scope="module")
def two_slots(ray_cluster, smollm2_dir, serve_ports):
    gcs = ray.get_runtime_context().gcs_address
    nodes = []
    try:
        nodes.append(_add_node(gcs))
        # Proxies on the head only: the extra nodes share this machine's ports. (On a pod,
        # the node's own proxy drains too, and the raylet's exit waits for it.)
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": serve_ports["http_host"], "port": serve_ports["http_port"]},
            grpc_options={
                "port": serve_ports["grpc_port"],
                "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS),
            },
        )
        config = AppConfig(
            mode="aggregated",
            enable_prefix_caching=False,
            router=RouterConfig(resources={"node:__internal_head__": 0.01}),
            aggregated=PoolConfig(num_cpus=1, resources={SLOT: 1}, kv_cache_bytes=KV),
        )
        service_ops.deploy(config, app_name="drain", route_prefix="/drain", **serve_ports)
        first = _replica_node()
        assert first == nodes[0].node_id
        nodes.append(_add_node(gcs))  # where the replica can move to
        yield gcs, first, f"127.0.0.1:{serve_ports['grpc_port']}"
    finally:
        serve.shutdown()
        for node in nodes:
            node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


def test_draining_a_node_moves_its_replica_and_lets_its_stream_finish(two_slots):
    gcs, node_id, address = two_slots
    request = generate_request(
        "Tell me about the sea.", max_tokens=TOKENS, temperature=0.0, ignore_eos=True
    )
    started, done = threading.Event(), threading.Event()
    messages, arrivals, states = [], [], {}

    def stream() -> None:
        with BatonClient(address, application="drain") as client:
            for msg in client.generate(request):
                messages.append(msg)
                arrivals.append(time.monotonic())
                started.set()

    streamer = threading.Thread(target=stream)
    watcher = threading.Thread(target=_watch_replica_states, args=(done, states))
    streamer.start()
    watcher.start()
    assert started.wait(60), "the stream did not start"
    result = node_drain.drain(node_id, deadline_s=120, address=gcs)
    streamer.join(120)
    done.set()
    watcher.join()

    assert result.drained and result.serving_left == 0, result
    # Serve stopped the old replica while it was still streaming, and the stream went on
    # to its end: a graceful stop, not a cut.
    assert "STOPPING" in states, states
    assert states["STOPPING"] < arrivals[-1], "the stream ended first; make it longer"
    assert sum(len(m.token_ids) for m in messages) == TOKENS
    assert messages[-1].usage.completion_tokens == TOKENS
    # The replacement, on the other node: its process may still be starting when the
    # stream ends.
    wait_for(lambda: _replica_hosts() not in ([], [node_id]), "the replacement replica")
    assert _replica_node() != node_id
    with BatonClient(address, application="drain") as client:
        reply = client.generate_unary(generate_request("Hi", max_tokens=4, temperature=0.0))
    assert reply.usage.completion_tokens == 4


def test_a_machine_with_several_nodes_needs_a_node_id(two_slots):
    # The session's head and the second extra node at least (a drained node's raylet
    # exits once it is idle).
    assert len(node_drain.raylets()) >= 2
    with pytest.raises(ValueError, match="--node-id is needed"):
        node_drain.local_node_id()


def test_bad_drain_requests_are_value_errors(two_slots):
    gcs, node_id, _ = two_slots
    with pytest.raises(ValueError, match="deadline_s must be >= 1"):
        node_drain.drain(node_id, deadline_s=0, address=gcs)
    with pytest.raises(ValueError, match="runs no raylet on this machine"):
        node_drain.drain("ab" * 28, deadline_s=5, address=gcs)
