"""A fixed pool of KV-cache blocks with reference counts and a content-addressed cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from workers.engine.block_hash import BlockHash

# A cached block's name: its KV-cache group (kv_groups.py) and its content hash. The
# groups' blocks of one prefix hold different layers, so each is cached on its own.
BlockKey = tuple[int, BlockHash]


@dataclass(frozen=True)
class _Cached:
    """What a cached block holds, kept so a hash hit can be confirmed before reuse."""

    key: BlockKey
    parent: BlockHash
    token_ids: tuple[int, ...]


class BlockPool:
    """Hands out block ids; a block returns to the free queue when its last holder lets go.

    Freed blocks join the back of the queue and allocation takes from the front,
    so the queue is least-recently-freed first. A block whose full contents were
    registered with `cache` keeps them when freed: until allocation reaches it at
    the front of the queue (evicting it), `cached_block` can find it by hash and
    `touch` can take it back out of the queue. Free therefore means reusable, not
    empty: a pool with every request finished is fully free.

    Changes to the set of cached keys are buffered as net "stored" / "evicted"
    events until `take_events`.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # Insertion-ordered for LRU order, a dict for O(1) removal when a cached block is reused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._contents: list[_Cached | None] = [None] * num_blocks
        self._by_key: dict[BlockKey, int] = {}
        # key -> True (stored) / False (evicted) since the last take_events; a store
        # and an evict of the same key in one batch cancel out.
        self._events: dict[BlockKey, bool] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._by_key)

    def cached_keys(self) -> list[BlockKey]:
        """Every cached block's key, in the order they were cached (a chain's parents
        before its children)."""
        return list(self._by_key)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
            self._evict(b)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        # Checked as a whole first, so a bad call changes nothing.
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b] = counts.get(b, 0) + 1
        for b, n in counts.items():
            if not 0 <= b < self.num_blocks or self._refs[b] < n:
                raise RuntimeError(f"block {b} freed more often than it is held")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # -- the cache -----------------------------------------------------------

    def cache(self, block: int, key: BlockKey, parent: BlockHash, token_ids: Sequence[int]) -> None:
        """Registers a held block's full, computed contents under `key`.

        If another block already holds the same contents (two requests computed the
        same prefix side by side), this one stays unregistered and is simply freed later.
        """
        if self._refs[block] < 1:
            raise RuntimeError(f"block {block} is cached while nobody holds it")
        current = self._contents[block]
        if current is not None:
            if current.key != key:
                raise RuntimeError(f"block {block} holds {current.key} and cannot become {key}")
            return
        if key in self._by_key:
            return
        self._contents[block] = _Cached(key, parent, tuple(token_ids))
        self._by_key[key] = block
        self._note(key, stored=True)

    def cached_block(
        self, key: BlockKey, parent: BlockHash, token_ids: Sequence[int]
    ) -> int | None:
        """The block holding exactly this parent and these tokens, or None.

        Comparing the parent hash and the token ids, not only the block's hash, means a
        hash collision can cost a recompute but never serve another prefix's K/V.
        """
        block = self._by_key.get(key)
        if block is None:
            return None
        held = self._contents[block]
        if held is None or held.parent != parent or held.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[int]) -> None:
        """Takes one more reference to each (cached) block, out of the free queue if needed."""
        for b in blocks:
            if self._contents[b] is None:
                raise RuntimeError(f"block {b} is shared but holds no cached contents")
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def take_events(self) -> tuple[list[BlockKey], list[BlockKey]]:
        """(stored, evicted) keys since the last call; the two lists never overlap."""
        stored = [k for k, s in self._events.items() if s]
        evicted = [k for k, s in self._events.items() if not s]
        self._events.clear()
        return stored, evicted

    def _evict(self, block: int) -> None:
        held = self._contents[block]
        if held is None:
            return
        self._contents[block] = None
        del self._by_key[held.key]
        self._note(held.key, stored=False)

    def _note(self, key: BlockKey, stored: bool) -> None:
        if self._events.get(key) is (not stored):
            del self._events[key]
        else:
            self._events[key] = stored
