"""The prefix registry's data structure: which replica holds which cached block, bounded,
least-recently-used dropped first (the registry itself: prefix_registry.py)."""

from __future__ import annotations

import itertools
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from workers.engine import BlockHash

# A replica not heard from for this long is forgotten with all it held
# (PrefixRegistryConfig.replica_ttl_s).
DEFAULT_REPLICA_TTL_S = 60.0


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
        replica_ttl_s: float = DEFAULT_REPLICA_TTL_S,
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
