"""The cluster-wide prefix registry: which replica holds which cached KV blocks.

Every replica's engine reports, per step, the block hashes its prefix cache
gained ("stored") and lost ("evicted"); the replica publishes them here. The
router hashes a prompt's full blocks with the same function
(`workers.engine.block_hash`) and asks how many leading blocks each replica
holds, to send the request where the longest prefix is already computed.

The registry is advisory. Events arrive late, the size bound drops entries a
replica still holds, and a replica may evict a block right after answering: a
wrong answer only costs a recompute, because the engine confirms every block by
its token ids before reusing it.

`PrefixIndex` (prefix_index.py) is the data structure (plain Python, testable without
Ray); `PrefixRegistry` is the actor around it, named and detached: one per Serve
application (`registry_names.app_registry_name`), unless applications name one to share
(`AppConfig.registry_name`). Replica ids and block hashes mean something only within
the application whose replicas published them, so applications on one cluster never
share a registry by default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

from serve_app.routing.prefix_index import DEFAULT_REPLICA_TTL_S, PrefixIndex
from serve_app.routing.registry_names import REGISTRY_NAMESPACE
from workers.engine import BlockHash

logger = logging.getLogger(__name__)

# How often each engine replica tells the registry it is alive (an empty `publish`),
# whether or not its cache changed.
HEARTBEAT_S = 10.0


@dataclass(frozen=True)
class PrefixRegistryConfig:
    # The actor's name (in `namespace`): an application's own (`app_registry_name`), or
    # the one its config names.
    name: str
    # One entry is one (block hash, replica) pair, about 300 bytes all told.
    max_entries: int = 1_000_000
    namespace: str = REGISTRY_NAMESPACE
    # A replica not heard from for this long (no events, no heartbeat: it crashed, or
    # its node went) is forgotten with all it held. Replicas heartbeat every
    # HEARTBEAT_S, so a live one never comes near it.
    replica_ttl_s: float = DEFAULT_REPLICA_TTL_S

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries}")
        if not self.replica_ttl_s > HEARTBEAT_S:
            raise ValueError(
                f"replica_ttl_s must exceed the replicas' {HEARTBEAT_S} s heartbeat, "
                f"got {self.replica_ttl_s}"
            )
        if not self.name or not self.namespace:
            raise ValueError("name and namespace must be non-empty: they locate the actor")


class PrefixRegistry:
    """The actor: a `PrefixIndex` behind Ray calls.

    A plain (non-async) actor runs one call at a time in arrival order, so each
    replica's batches are applied in the order it sent them.
    """

    def __init__(self, max_entries: int, replica_ttl_s: float):
        self._index = PrefixIndex(max_entries, replica_ttl_s)

    def publish(self, replica_id: str, stored: list[BlockHash], evicted: list[BlockHash]) -> str:
        return self._index.publish(replica_id, stored, evicted)

    def longest_prefixes(self, hashes: list[BlockHash]) -> dict[str, int]:
        return self._index.longest_prefixes(hashes)

    def remove_replica(self, replica_id: str) -> int:
        return self._index.remove_replica(replica_id)

    def stats(self) -> dict[str, int]:
        return self._index.stats()


def get_or_create_registry(config: PrefixRegistryConfig) -> ray.actor.ActorHandle:
    """The named registry actor, started on first use (Ray must be initialised).

    Detached, so it outlives whichever process created it (until `remove_registry`, which
    `baton stop` calls for an application's own); when it already exists, its original
    `max_entries` and `replica_ttl_s` stay in force.
    """
    actor = ray.remote(PrefixRegistry).options(
        name=config.name,
        namespace=config.namespace,
        lifetime="detached",
        get_if_exists=True,
        # Not Ray's default: from a TP replica that would be the replica's own placement
        # group (Serve captures child actors in it), which dies with the replica.
        scheduling_strategy="DEFAULT",
        # Bookkeeping only: it must never wait for, or take, a CPU a model needs.
        num_cpus=0,
        # Its node lost, it starts again elsewhere (empty: the index is advisory).
        max_restarts=-1,
    )
    return actor.remote(config.max_entries, config.replica_ttl_s)
