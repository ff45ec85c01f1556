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

`PrefixIndex` is the data structure (plain Python, testable without Ray);
`PrefixRegistry` is the actor around it, one per cluster, named and detached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import ray

from workers.engine.block_hash import BlockHash

__all__ = ["PrefixIndex", "PrefixRegistry", "PrefixRegistryConfig", "get_or_create_registry"]


@dataclass(frozen=True)
class PrefixRegistryConfig:
    # One entry is one (block hash, replica) pair, about 300 bytes all told.
    max_entries: int = 1_000_000
    name: str = "baton-prefix-registry"
    namespace: str = "baton"

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries}")
        if not self.name or not self.namespace:
            raise ValueError("name and namespace must be non-empty: they locate the actor")


class PrefixIndex:
    """(block hash, replica) entries, bounded, least-recently-used dropped first."""

    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._lru: OrderedDict[tuple[BlockHash, str], None] = OrderedDict()
        self._holders: dict[BlockHash, set[str]] = {}
        # Every known replica, even one whose entries are all gone, until it is removed.
        self._by_replica: dict[str, set[BlockHash]] = {}
        self._num_dropped = 0
        self._num_queries = 0

    def publish(
        self, replica_id: str, stored: Iterable[BlockHash], evicted: Iterable[BlockHash]
    ) -> None:
        """Applies one batch of a replica's events: evictions first, then stores."""
        _check_replica_id(replica_id)
        stored, evicted = _checked_hashes(stored), _checked_hashes(evicted)
        held = self._by_replica.setdefault(replica_id, set())
        for h in evicted:
            key = (h, replica_id)
            # An eviction of something not held (dropped by the bound, or never seen) is moot.
            if key in self._lru:
                del self._lru[key]
                self._forget(h, replica_id, held)
        for h in stored:
            key = (h, replica_id)
            if key in self._lru:
                self._lru.move_to_end(key)
                continue
            self._lru[key] = None
            self._holders.setdefault(h, set()).add(replica_id)
            held.add(h)
        while len(self._lru) > self.max_entries:
            (h, owner), _ = self._lru.popitem(last=False)
            self._forget(h, owner, self._by_replica[owner])
            self._num_dropped += 1

    def longest_prefixes(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For hashes in prompt order: each known replica -> how many leading ones it holds."""
        hashes = _checked_hashes(hashes)
        self._num_queries += 1
        result = dict.fromkeys(self._by_replica, 0)
        alive: set[str] | None = None
        for depth, h in enumerate(hashes, start=1):
            holders = self._holders.get(h, set())
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for replica_id in alive:
                result[replica_id] = depth
                # A block routers keep asking for is worth keeping.
                self._lru.move_to_end((h, replica_id))
        return result

    def remove_replica(self, replica_id: str) -> int:
        """Forgets a replica and all it held; returns how many entries went."""
        held = self._by_replica.pop(replica_id, set())
        for h in held:
            del self._lru[(h, replica_id)]
            holders = self._holders[h]
            holders.discard(replica_id)
            if not holders:
                del self._holders[h]
        return len(held)

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._lru),
            "max_entries": self.max_entries,
            "hashes": len(self._holders),
            "replicas": len(self._by_replica),
            "dropped_entries": self._num_dropped,
            "queries": self._num_queries,
        }

    def _forget(self, h: BlockHash, replica_id: str, held: set[BlockHash]) -> None:
        held.discard(h)
        holders = self._holders[h]
        holders.discard(replica_id)
        if not holders:
            del self._holders[h]


class PrefixRegistry:
    """The actor: a `PrefixIndex` behind Ray calls.

    A plain (non-async) actor runs one call at a time in arrival order, so each
    replica's batches are applied in the order it sent them.
    """

    def __init__(self, max_entries: int):
        self._index = PrefixIndex(max_entries)

    def publish(self, replica_id: str, stored: list[BlockHash], evicted: list[BlockHash]) -> None:
        self._index.publish(replica_id, stored, evicted)

    def longest_prefixes(self, hashes: list[BlockHash]) -> dict[str, int]:
        return self._index.longest_prefixes(hashes)

    def remove_replica(self, replica_id: str) -> int:
        return self._index.remove_replica(replica_id)

    def stats(self) -> dict[str, int]:
        return self._index.stats()


def get_or_create_registry(config: PrefixRegistryConfig | None = None) -> ray.actor.ActorHandle:
    """The cluster's registry actor, started on first use (Ray must be initialised).

    Detached, so it outlives whichever process created it; when it already exists,
    its original `max_entries` stays in force.
    """
    config = config or PrefixRegistryConfig()
    actor = ray.remote(PrefixRegistry).options(
        name=config.name,
        namespace=config.namespace,
        lifetime="detached",
        get_if_exists=True,
        # Bookkeeping only: it must never wait for, or take, a CPU a model needs.
        num_cpus=0,
        # Its node lost, it starts again elsewhere (empty: the index is advisory).
        max_restarts=-1,
    )
    return actor.remote(config.max_entries)


def _check_replica_id(replica_id: str) -> None:
    if not isinstance(replica_id, str) or not replica_id:
        raise ValueError(f"replica_id must be a non-empty string, got {replica_id!r}")


def _checked_hashes(hashes: Iterable[BlockHash]) -> list[BlockHash]:
    hashes = list(hashes)
    for h in hashes:
        if not isinstance(h, BlockHash):
            raise ValueError(
                f"expected BlockHash values (workers.engine.block_hash), got {type(h).__name__}"
            )
    return hashes
