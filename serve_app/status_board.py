"""Where engine replicas post their latest stats, and `baton serve` the deployed config
and the ingress ports it started Serve with (serve_app/ops/ports.py).

Serve has no public call that reaches every replica of a deployment, so each replica
posts a snapshot here each time Serve collects its routing stats (about once a second);
`baton status` reads them all at once. Snapshots older than `max_age_s` belong to
replicas that are gone and are left out. `baton scale` starts from the config kept here
(on the board of the default name, whichever board the replicas post to).
"""

from __future__ import annotations

import time
from typing import Any

import ray

BOARD_NAMESPACE = "baton"
DEFAULT_BOARD_NAME = "baton-status"


class StatusBoard:
    def __init__(self) -> None:
        self._posts: dict[str, tuple[float, dict[str, Any]]] = {}
        self._configs: dict[str, dict[str, Any]] = {}
        self._ingress: dict[str, Any] | None = None

    def set_config(self, app_name: str, config: dict[str, Any] | None) -> dict[str, Any] | None:
        """Keeps (or with None forgets) an application's config; returns the one it had."""
        previous = self._configs.pop(app_name, None)
        if config is not None:
            self._configs[app_name] = config
        return previous

    def config(self, app_name: str) -> dict[str, Any] | None:
        return self._configs.get(app_name)

    def set_ingress(self, record: dict[str, Any] | None) -> None:
        self._ingress = record

    def ingress(self) -> dict[str, Any] | None:
        return self._ingress

    def post(self, replica_id: str, snapshot: dict[str, Any]) -> None:
        self._posts[replica_id] = (time.monotonic(), snapshot)

    def remove(self, replica_id: str) -> None:
        self._posts.pop(replica_id, None)

    def snapshots(self, max_age_s: float = 10.0) -> list[dict[str, Any]]:
        now = time.monotonic()
        self._posts = {r: p for r, p in self._posts.items() if now - p[0] <= max_age_s}
        return [snapshot for _, snapshot in self._posts.values()]


def get_or_create_board(name: str) -> ray.actor.ActorHandle:
    """The named board actor (Ray must be initialised); detached, created on first use."""
    actor = ray.remote(StatusBoard).options(
        name=name,
        namespace=BOARD_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        # Not Ray's default: from a TP replica that would be the replica's own placement
        # group (Serve captures child actors in it), which dies with the replica.
        scheduling_strategy="DEFAULT",
        num_cpus=0,
        max_restarts=-1,  # its node lost, it starts again elsewhere (replicas post anew)
    )
    return actor.remote()


def find_board(name: str) -> ray.actor.ActorHandle | None:
    """The named board actor if one exists, without creating it."""
    try:
        return ray.get_actor(name, namespace=BOARD_NAMESPACE)
    except ValueError:
        return None
