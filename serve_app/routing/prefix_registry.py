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
`PrefixRegistry` is the actor around it, named and detached: one per Serve application
(`app_registry_name`), unless applications name one to share (`AppConfig.registry_name`).
Replica ids and block hashes mean something only within the application whose replicas
published them, so applications on one cluster never share a registry by default.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import ray

from workers.engine import BlockHash

__all__ = [
    "PrefixIndex",
    "PrefixRegistry",
    "PrefixRegistryConfig",
    "RegistryLookup",
    "app_registry_name",
    "get_or_create_registry",
    "remove_registry",
]

logger = logging.getLogger(__name__)

# How often each engine replica tells the registry it is alive (an empty `publish`),
# whether or not its cache changed.
HEARTBEAT_S = 10.0

# The Ray namespace of every registry actor (the status board's too).
REGISTRY_NAMESPACE = "baton"
# What an application's own registry is named after (`app_registry_name`).
REGISTRY_NAME_PREFIX = "baton-prefix-registry"


def app_registry_name(app_name: str) -> str:
    """The name of Serve application `app_name`'s own registry: what its router and
    replicas use unless its config names one (`AppConfig.registry_name`). Distinct for
    distinct applications, so no application's routing hears of another's replicas."""
    return f"{REGISTRY_NAME_PREFIX}-{app_name}"


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
    replica_ttl_s: float = 60.0

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


class PrefixIndex:
    """(block hash, replica) entries, bounded, least-recently-used dropped first.

    Recency runs deepest block first: a chain's blocks are stored and matched in prompt
    order, and refreshing them in reverse leaves its root the most recent, so the bound
    drops a chain from its tail. Dropping roots first would orphan the rest of the chain,
    entries no prefix match can reach any more. That holds within one batch of events
    and one query: a prompt stored over several engine steps (longer than a step's token
    budget, or its decode blocks) has older roots until a router asks for it, which
    refreshes the whole matched run. (The hashes carry no parent links to do better.)
    """

    def __init__(
        self,
        max_entries: int,
        replica_ttl_s: float = PrefixRegistryConfig.replica_ttl_s,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.replica_ttl_s = replica_ttl_s
        self._clock = clock
        self._lru: OrderedDict[tuple[BlockHash, str], None] = OrderedDict()
        self._holders: dict[BlockHash, set[str]] = {}
        # Every known replica, even one whose entries are all gone, until it is removed
        # or expires; and when each was last heard from.
        self._by_replica: dict[str, set[BlockHash]] = {}
        self._last_heard: dict[str, float] = {}
        # Each known replica's session (see publish): unique across restarts of the actor.
        self._sessions: dict[str, str] = {}
        self._session_ids = (f"{uuid.uuid4().hex[:12]}-{n}" for n in itertools.count(1))
        self._num_dropped = 0
        self._num_queries = 0
        self._num_expired_replicas = 0

    def publish(
        self, replica_id: str, stored: Iterable[BlockHash], evicted: Iterable[BlockHash]
    ) -> str:
        """Applies one batch of a replica's events: evictions first, then stores. An
        empty batch is the replica's heartbeat.

        Returns the replica's session: a new one whenever the index did not know the
        replica (its first batch; after it expired or was removed; every replica's, in a
        registry restarted empty). The index holds only what the session's batches
        said, so a replica that sees its session change sends its whole cache again."""
        _check_replica_id(replica_id)
        stored, evicted = _checked_hashes(stored), _checked_hashes(evicted)
        if replica_id not in self._by_replica:
            self._sessions[replica_id] = next(self._session_ids)
        held = self._by_replica.setdefault(replica_id, set())
        self._last_heard[replica_id] = self._clock()
        for h in evicted:
            key = (h, replica_id)
            # An eviction of something not held (dropped by the bound, or never seen) is moot.
            if key in self._lru:
                del self._lru[key]
                self._forget(h, replica_id, held)
        for h in reversed(stored):  # deepest first (see the class docstring)
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
        return self._sessions[replica_id]

    def longest_prefixes(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For hashes in prompt order: each known replica -> how many leading ones it holds."""
        hashes = _checked_hashes(hashes)
        self._num_queries += 1
        self._expire_silent_replicas()
        result = dict.fromkeys(self._by_replica, 0)
        matched: list[tuple[BlockHash, str]] = []
        alive: set[str] | None = None
        for depth, h in enumerate(hashes, start=1):
            holders = self._holders.get(h, set())
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for replica_id in alive:
                result[replica_id] = depth
                matched.append((h, replica_id))
        # A block routers keep asking for is worth keeping (deepest refreshed first).
        for key in reversed(matched):
            self._lru.move_to_end(key)
        return result

    def _expire_silent_replicas(self) -> None:
        deadline = self._clock() - self.replica_ttl_s
        for replica_id in [r for r, t in self._last_heard.items() if t < deadline]:
            self.remove_replica(replica_id)
            self._num_expired_replicas += 1

    def remove_replica(self, replica_id: str) -> int:
        """Forgets a replica and all it held; returns how many entries went."""
        self._last_heard.pop(replica_id, None)
        self._sessions.pop(replica_id, None)
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
            "expired_replicas": self._num_expired_replicas,
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


def remove_registry(name: str, namespace: str = REGISTRY_NAMESPACE) -> bool:
    """Kills the named registry actor for good (Ray must be initialised); False if there
    is none. For an application's own registry once the application is deleted: while
    any of its replicas or routers runs, they would only start a new, empty one."""
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True


class RegistryLookup:
    """A router's way to the registry: the hints for a prompt, or none. Losing the
    registry (a new one is started) or waiting on it past `wait_s` (it restarts, or falls
    behind every replica's cache events) costs routing hints, never a request or more
    than `wait_s` of its latency."""

    def __init__(self, config: PrefixRegistryConfig, wait_s: float) -> None:
        self.config, self.wait_s = config, wait_s
        self.actor = get_or_create_registry(config)
        self.num_timeouts = 0

    async def longest_prefixes(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        lookup = self.actor.longest_prefixes.remote(list(block_hashes))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(lookup.future()), self.wait_s)
        except ray.exceptions.RayActorError:
            logger.warning("the prefix registry is gone; starting a new one")
            self.actor = get_or_create_registry(self.config)
        except asyncio.TimeoutError:
            self.num_timeouts += 1
            if self.num_timeouts & (self.num_timeouts - 1) == 0:  # the 1st, 2nd, 4th... time
                logger.warning(
                    "the prefix registry took over %.2f s to answer (%d times so far); "
                    "routing without its hints",
                    self.wait_s,
                    self.num_timeouts,
                )
        return {}


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
