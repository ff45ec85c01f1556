"""The ports clients reach: Serve's ingress has one HTTP and one gRPC port per cluster,
fixed when Serve starts.

`serve.start` on a Serve that is already running keeps the ports it runs with (and warns
only about HTTP), so `baton serve --grpc-port P` for a second application would announce
a port nothing listens on. `service_ops.deploy` keeps the ports it started Serve with on
the status board; on a running Serve it announces those, and refuses a port asked for
explicitly that differs from them, since only restarting Serve could change it. The
record goes when `baton stop` stops Serve, and is ignored while Serve is down; only a
Serve restarted outside Baton while Baton was not looking (`serve shutdown`, then `serve
run` on other ports) would outlive it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import ray
from ray import serve

from serve_app.serve_config import GRPC_PORT, HTTP_PORT


@dataclass(frozen=True)
class Ingress:
    http_port: int
    grpc_port: int

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> Ingress | None:
        return None if record is None else cls(**record)


def serve_running() -> bool:
    """Whether a Serve instance runs on the connected cluster. `serve.status()` answers
    an empty status when none does; a running one lists its proxies (one per node)."""
    status = serve.status()
    return bool(status.proxies or status.applications)


def ingress_for(
    http_port: int | None,
    grpc_port: int | None,
    *,
    running: bool,
    recorded: Ingress | None,
) -> Ingress | None:
    """The ports a deploy's clients will reach. Serve not `running`: the ones asked for,
    or the defaults, which it is started with. Running: the ones it was started with
    (`recorded` by an earlier deploy; None if Serve was started by something else, e.g. a
    RayService, whose config holds them). ValueError for a port asked for explicitly
    that the running Serve does not serve on."""
    if not running:
        return Ingress(http_port or HTTP_PORT, grpc_port or GRPC_PORT)
    if recorded is None:
        return None
    for field, asked, serving in (
        ("http_port", http_port, recorded.http_port),
        ("grpc_port", grpc_port, recorded.grpc_port),
    ):
        if asked is not None and asked != serving:
            flag = "--" + field.replace("_", "-")
            raise ValueError(
                f"{field}: Serve already runs on this cluster with {field} {serving}, and "
                f"its ports are fixed when it starts, not per application: drop {flag} "
                f"(or pass {serving}), or `baton stop` every application, which stops "
                f"Serve, and serve again with {flag} {asked}"
            )
    return recorded


# The board is detached, so it outlives upgrades: one an earlier Baton started keeps no
# ports (its handle has no such methods), which reads as Serve started outside Baton.
def recorded_ingress(board: ray.actor.ActorHandle) -> Ingress | None:
    """The ports `deploy` last started Serve with, as kept on the board."""
    if not hasattr(board, "ingress"):
        return None
    return Ingress.from_record(ray.get(board.ingress.remote()))


def record_ingress(board: ray.actor.ActorHandle, ingress: Ingress | None) -> None:
    if hasattr(board, "set_ingress"):
        ray.get(board.set_ingress.remote(None if ingress is None else ingress.to_record()))
