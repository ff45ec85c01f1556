"""Taking a Ray node out of service without cutting its streams: `baton drain`, the
preStop hook of the Helm chart's worker pods.

Kubernetes stops a pod (a node drain, an eviction, a scale-down it picked itself) by
running the pod's preStop hook, then sending SIGTERM, then SIGKILL once
terminationGracePeriodSeconds have passed. A bare `ray stop` there ends every stream the
pod's replica is serving. Draining the Ray node first, the GCS call Ray's autoscaler
makes before it removes a node, lets Serve migrate the node's replicas: it starts a
replacement elsewhere, routes new requests to it, and stops the old replica gracefully
(each pool's `graceful_shutdown_timeout_s`), so streams in flight finish. Serve's
ingress on the node (its HAProxy, or its Python proxy) drains too, once the streams it
carries end. `drain` asks for that and then waits until no Serve replica or ingress
process is left on the node (or its raylet has exited), or until the deadline; the
hook stops Ray after it either way. (The raylet's own exit is no signal to wait for: a
drained node with nothing left to serve may stay up until it is killed.)

The node's raylet is found in /proc: it carries its node id on its command line, and
Ray's workers are its children (titled `ray::ServeReplica:...` when they host a replica,
`ray::HAProxyManager` for the actor that runs the node's HAProxy, `ray::ProxyActor` for
a Python proxy). That needs no dashboard and no connection to the cluster, and on a
pod (one raylet) no node id either.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SERVING_TITLES = ("ray::ServeReplica:", "ray::HAProxyManager", "ray::ProxyActor")
# `ray drain-node` only starts a CLI and makes one GCS call; an unreachable GCS (the head
# already gone) would hold the hook for about 40 s.
_DRAIN_CALL_TIMEOUT_S = 15.0
_PROC = Path("/proc")


@dataclass(frozen=True)
class DrainResult:
    node_id: str
    serving_left: int  # Serve replica and ingress processes left when `drain` returned
    waited_s: float

    @property
    def drained(self) -> bool:
        return self.serving_left == 0


def cmdline(pid: int) -> list[str]:
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:  # gone meanwhile, or not ours to read
        return []
    return raw.decode(errors="replace").rstrip("\0").split("\0")


def _pids() -> list[int]:
    return [int(p.name) for p in _PROC.iterdir() if p.name.isdigit()]


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (state, parent, ...); [] once the
    process is gone."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return []
    # The command name in parentheses may itself hold spaces or parentheses.
    return stat.rsplit(")", 1)[1].split()


def _parent(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields else None


def raylets() -> dict[str, int]:
    """This machine's raylets: node id (hex) -> process id."""
    found = {}
    for pid in _pids():
        argv = cmdline(pid)
        if argv and argv[0].endswith("/raylet"):
            for arg in argv[1:]:
                if arg.startswith("--node_id="):
                    found[arg.removeprefix("--node_id=")] = pid
    return found


def children(pid: int) -> list[int]:
    return [child for child in _pids() if _parent(child) == pid]


def serving_processes(raylet_pid: int) -> list[int]:
    """The Serve replica and ingress processes a raylet started (Ray's workers are its
    children)."""
    return [
        pid for pid in children(raylet_pid) if " ".join(cmdline(pid)).startswith(SERVING_TITLES)
    ]


def _alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return bool(fields) and fields[0] != "Z"  # a zombie has exited, just not been reaped


def local_node_id() -> str:
    """The node id of this machine's one raylet (a pod's); ValueError when there are
    none or several, naming the flag that picks one."""
    found = raylets()
    if not found:
        raise ValueError("no Ray node runs on this machine: there is nothing to drain")
    if len(found) > 1:
        raise ValueError(
            f"--node-id is needed: this machine runs {len(found)} Ray nodes "
            f"({', '.join(found)}), and without it `baton drain` takes the only one"
        )
    return next(iter(found))


def request_drain(node_id: str, deadline_s: int, address: str | None = None) -> None:
    """Asks the GCS to drain `node_id`, announcing it is killed in `deadline_s`.

    Through `ray drain-node`, the CLI over the call Ray's autoscaler makes. The reason
    given is preemption: the node goes away whether or not it is busy (Ray's other
    reason, idle termination, is the autoscaler's for nodes it found idle).
    ConnectionError with Ray's message if the GCS refuses.
    """
    # The `ray` beside this interpreter: a pod's hook may run without the venv on PATH.
    ray_cli = Path(sys.executable).with_name("ray")
    command = [
        str(ray_cli) if ray_cli.exists() else "ray",
        "drain-node",
        f"--node-id={node_id}",
        "--reason=DRAIN_NODE_REASON_PREEMPTION",
        "--reason-message=baton drain: the pod is stopping",
        f"--deadline-remaining-seconds={deadline_s}",
    ]
    if address:
        command.append(f"--address={address}")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_DRAIN_CALL_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise ConnectionError(
            f"Ray did not answer the drain of node {node_id} within {_DRAIN_CALL_TIMEOUT_S:g}s"
        ) from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise ConnectionError(
            f"Ray refused to drain node {node_id}: {detail[-1] if detail else 'no message'}"
        )


def drain(
    node_id: str | None = None,
    *,
    deadline_s: int,
    address: str | None = None,
    poll_s: float = 1.0,
) -> DrainResult:
    """Drains the node (default: this machine's only one) and waits, until `deadline_s`
    after the call, for Serve to move its replicas away and retire its ingress.
    ConnectionError (and no wait) when Ray refuses or does not answer the drain."""
    if deadline_s < 1:
        raise ValueError(f"deadline_s must be >= 1 second, got {deadline_s}")
    node_id = node_id or local_node_id()
    raylet = raylets().get(node_id)
    if raylet is None:
        raise ValueError(f"node {node_id} runs no raylet on this machine; see `ray status`")
    start = time.monotonic()
    # The GCS dates its deadline from when the CLI has started, later than `start`: the
    # wait ends at the same moment or after, never while Serve still counts on the time.
    request_drain(node_id, deadline_s, address)
    end = time.monotonic() + deadline_s
    while (left := _serving_left(raylet)) and time.monotonic() < end:
        time.sleep(poll_s)
    return DrainResult(node_id=node_id, serving_left=left, waited_s=time.monotonic() - start)


def _serving_left(raylet_pid: int) -> int:
    # A raylet that exited took its workers with it (they would be orphans, not children).
    return len(serving_processes(raylet_pid)) if _alive(raylet_pid) else 0
