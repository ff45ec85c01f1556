"""Per-sequence block tables on top of the block pool, with prefix caching, for every
KV-cache group of the model (workers/kv/kv_groups.py).

A sequence holds one block table per group, all of the same length: entry i is the
block holding tokens [i * block_size, (i + 1) * block_size) of that group's layers. A
full-attention group's table holds every block. A sliding group's table holds
`NULL_BLOCK` for the blocks its window has passed: they go back to the pool as soon as
the next query no longer reaches them, while the sequence runs.

Every full block a sequence has computed is registered in the pool under its group and
its chained content hash (`block_hash.py`), so a later sequence that starts with the
same tokens, under the same model and cache salt, attaches those blocks instead of
recomputing them. A shared block is only ever read: a sequence attaches full blocks and
writes its own K/V into blocks after them.

The prefix-cache rule under a hybrid cache: a cached prefix of n blocks is usable only
if every full-attention group holds all n of them and every sliding group holds the
blocks its window reaches from the token after them (position n * block_size) back.
The longest such n is the hit; a sliding group's earlier blocks are not needed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from workers.engine.block_hash import BlockHash, hash_block, root_hash
from workers.engine.block_pool import BlockPool
from workers.engine.sequence import Sequence
from workers.kv.kv_groups import KVCacheGroups

log = logging.getLogger(__name__)

# Called with (stored, evicted) block hashes, once per batch of changes.
KVEventCallback = Callable[[list[BlockHash], list[BlockHash]], None]

# A sliding group's table entry for a block behind its window: none is held.
NULL_BLOCK = -1

# One full-attention group: a plain paged cache (every layer alike).
_ONE_GROUP = KVCacheGroups(((0,),), (None,))


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        groups: KVCacheGroups = _ONE_GROUP,
        enable_prefix_caching: bool = True,
        model_id: str = "model",
        on_events: KVEventCallback | None = None,
    ):
        self.block_size = block_size
        self.groups = groups
        self._sliding = [g for g, w in enumerate(groups.windows) if w is not None]
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id = model_id
        self.on_events = on_events
        self._resend_all = False  # see resend_cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_groups(self) -> int:
        return self.groups.num_groups

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds, of every group."""
        return sum(b != NULL_BLOCK for table in seq.block_tables for b in table)

    def find_cached_prefix(self, seq: Sequence) -> int:
        """Attaches the longest cached prefix of `seq`'s leading full blocks; returns its tokens.

        The prefix stops short of the last known token, so the step that follows still
        computes at least one token and so yields logits, and short of the positions
        whose prompt logprobs are still due. `seq.num_computed_tokens`
        becomes the returned count.
        """
        usable = (seq.num_tokens - 1) // self.block_size
        if seq.num_prompt_logprobs_due:  # positions whose logprobs are due must be computed
            usable = min(usable, len(seq.prompt_logprobs) // self.block_size)
        tokens = seq.token_ids(0, usable * self.block_size)
        hashes = self.block_hashes(seq, usable) if self.enable_prefix_caching else []
        self.attach(seq, self.cached_prefix(hashes, tokens, seq.cache_salt))
        return seq.num_computed_tokens

    def cached_prefix(
        self, block_hashes: list[BlockHash], token_ids: list[int], cache_salt: str | None
    ) -> list[list[int]]:
        """Per group, the blocks of the longest cached prefix of these leading full blocks
        that the module's rule allows (not taken): all of them in a full-attention group;
        in a sliding group NULL_BLOCK before its window, the cached blocks from there.

        A block counts only if its parent hash and tokens match too (see BlockPool.cached_block).
        """
        if not self.enable_prefix_caching:
            return [[] for _ in range(self.num_groups)]
        found = [
            self._cached_run(g, block_hashes, token_ids, cache_salt) for g in range(self.num_groups)
        ]
        full = [len(f) for f, w in zip(found, self.groups.windows, strict=True) if w is None]
        n = min(full, default=len(block_hashes))
        while n > 0 and not all(self._window_held(g, found[g], n) for g in self._sliding):
            n -= 1
        tables = []
        for g, blocks in enumerate(found):
            lo = self._first_block(g, n * self.block_size)
            tables.append([NULL_BLOCK] * lo + list(blocks[lo:n]))
        return tables

    def num_cached_blocks(
        self, block_hashes: list[BlockHash], token_ids: list[int], cache_salt: str | None
    ) -> int:
        """How many of these leading full blocks the prefix cache holds now, by the rule."""
        return len(self.cached_prefix(block_hashes, token_ids, cache_salt)[0])

    def _cached_run(
        self, group: int, block_hashes: list[BlockHash], token_ids: list[int], salt: str | None
    ) -> list[int | None]:
        """Group `group`'s cached block for each of these blocks, None where it has none:
        up to the first miss for a full-attention group, all of them for a sliding one
        (which needs only a window's blocks)."""
        parent = root_hash(self.model_id, salt)
        sliding = self.groups.windows[group] is not None
        blocks: list[int | None] = []
        for i, h in enumerate(block_hashes):
            tokens = token_ids[i * self.block_size : (i + 1) * self.block_size]
            full = len(tokens) == self.block_size
            block = self.pool.cached_block((group, h), parent, tokens) if full else None
            if block is None and not sliding:
                break
            blocks.append(block)
            parent = h
        return blocks

    def _window_held(self, group: int, found: list[int | None], n: int) -> bool:
        lo = self._first_block(group, n * self.block_size)
        return len(found) >= n and all(b is not None for b in found[lo:n])

    def attach(self, seq: Sequence, tables: list[list[int]]) -> None:
        """Gives `seq`, holding nothing yet, these cached blocks (per group, as
        `cached_prefix` gives them) as its leading, computed ones."""
        if any(seq.block_tables) or seq.num_computed_tokens:
            raise RuntimeError(
                f"{seq.request_id}: prefix lookup on a sequence that already holds blocks"
            )
        if len(tables) != self.num_groups or len({len(t) for t in tables}) > 1:
            raise RuntimeError(f"{seq.request_id}: a prefix needs {self.num_groups} equal tables")
        self.pool.touch(b for t in tables for b in t if b != NULL_BLOCK)
        seq.block_tables = [list(t) for t in tables]
        seq.num_committed_blocks = len(tables[0])
        seq.num_computed_tokens = len(tables[0]) * self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grows `seq`'s tables to hold `num_new_tokens` more for a step that computes
        them (each a query); False if the pool is short. Blocks no sliding window
        reaches any more go back to the pool first."""
        start = seq.num_computed_tokens
        return self._grow(seq, start + num_new_tokens, first_query=start)

    def allocate_context(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows `seq`'s tables to hold a context of `num_tokens` whose K/V arrive from
        elsewhere (a KV import): a sliding group takes only the blocks its window reaches
        from the next query, at position `num_tokens`. False if the pool is short."""
        return self._grow(seq, num_tokens, first_query=num_tokens)

    def _grow(self, seq: Sequence, end: int, first_query: int) -> bool:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in range(self.num_groups)]
        self._drop_behind_window(seq, first_query)
        hi = self.blocks_for_tokens(end)
        starts = [
            max(len(table), self._first_block(g, first_query))
            for g, table in enumerate(seq.block_tables)
        ]
        needed = sum(max(0, hi - lo) for lo in starts)
        if needed > self.pool.num_free:
            return False
        for table, lo in zip(seq.block_tables, starts, strict=True):
            if hi > lo:
                table.extend([NULL_BLOCK] * (lo - len(table)))
                table.extend(self.pool.allocate(hi - lo))
        return True

    def free_token_slots(self, seq: Sequence, num_tokens: int) -> int:
        """Tokens `seq` could hold past its first `num_tokens` with the blocks it has and
        those free (each new block needed once per group)."""
        held = len(seq.block_tables[0]) * self.block_size if seq.block_tables else 0
        return held - num_tokens + self.pool.num_free // self.num_groups * self.block_size

    def trim(self, seq: Sequence) -> None:
        """Frees the blocks `seq` holds past its known tokens (slots of rejected drafts)."""
        keep = self.blocks_for_tokens(seq.num_tokens)
        for table in seq.block_tables:
            if len(table) > keep:
                self.pool.free([b for b in table[keep:][::-1] if b != NULL_BLOCK])
                del table[keep:]

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Registers the blocks `seq` has filled completely since the last call, then lets
        go of the sliding groups' blocks that the next query's window no longer reaches.

        Called after a step has written their K/V (`num_computed_tokens` advanced),
        never before: a block is findable only once its contents are real.
        """
        full = seq.num_computed_tokens // self.block_size
        if full > seq.num_committed_blocks:
            if seq.block_tables and full > len(seq.block_tables[0]):
                raise RuntimeError(
                    f"{seq.request_id}: {full} computed blocks but a table of "
                    f"{len(seq.block_tables[0])}"
                )
            if self.enable_prefix_caching:
                self._register(seq, full)
            seq.num_committed_blocks = full
        self._drop_behind_window(seq, seq.num_computed_tokens)

    def _register(self, seq: Sequence, full: int) -> None:
        hashes = self.block_hashes(seq, full)
        for i in range(seq.num_committed_blocks, full):
            parent = hashes[i - 1] if i else self._root(seq)
            tokens = self._block_tokens(seq, i)
            for g, table in enumerate(seq.block_tables):
                if table[i] != NULL_BLOCK:
                    self.pool.cache(table[i], (g, hashes[i]), parent, tokens)

    def _drop_behind_window(self, seq: Sequence, first_query: int) -> None:
        """Frees each sliding group's blocks before the window of a query at `first_query`.
        A sliding table's NULL_BLOCK entries are always a leading run, so the scan back
        from the window's first block stops at the first one."""
        for g in self._sliding:
            if not seq.block_tables:
                return
            table = seq.block_tables[g]
            lo = min(self._first_block(g, first_query), len(table))
            dropped = []
            for i in range(lo - 1, -1, -1):
                if table[i] == NULL_BLOCK:
                    break
                dropped.append(table[i])
                table[i] = NULL_BLOCK
            if dropped:
                # Oldest first: they queue for eviction in that order.
                self.pool.free(dropped[::-1])

    def free(self, seq: Sequence) -> None:
        # Tail first: freed blocks queue for eviction in that order, so a sequence's
        # leading blocks, the ones other requests are likeliest to share, stay longest.
        for table in seq.block_tables:
            self.pool.free([b for b in table[::-1] if b != NULL_BLOCK])
        seq.block_tables = []
        seq.num_committed_blocks = 0

    def resend_cached(self) -> None:
        """Makes the next flush hand `on_events` every cached block as stored (and what the
        batch evicted, which a listener applies first): the whole state, for a listener
        that lost what it was told (a prefix registry restarted, or one that forgot this
        engine). Callable from any thread: it only sets a flag."""
        self._resend_all = True

    def flush_events(self) -> None:
        """Hands the changes to the cached set since the last flush to `on_events`: the
        primary group's (KVCacheGroups.primary), whose blocks stand for a cached prefix."""
        stored, evicted = self.pool.take_events()
        if self._resend_all:
            self._resend_all = False
            stored = self.pool.cached_keys()
        primary = self.groups.primary
        stored_hashes = [h for g, h in stored if g == primary]
        evicted_hashes = [h for g, h in evicted if g == primary]
        if self.on_events is not None and (stored_hashes or evicted_hashes):
            try:
                self.on_events(stored_hashes, evicted_hashes)
            except Exception:
                # The registry is advisory: a lost batch costs a recompute later,
                # a raised one would fail every request in this step.
                log.exception("dropped a KV event batch: the on_events callback failed")

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Hashes of `seq`'s first `num_blocks` full blocks, computed once and kept on `seq`."""
        hashes = seq.block_hashes
        if num_blocks * self.block_size > seq.num_tokens:
            raise RuntimeError(f"{seq.request_id}: asked to hash beyond its known tokens")
        parent = hashes[-1] if hashes else self._root(seq)
        for i in range(len(hashes), num_blocks):
            parent = hash_block(parent, self._block_tokens(seq, i))
            hashes.append(parent)
        return hashes[:num_blocks]

    def _first_block(self, group: int, first_query: int) -> int:
        return self.groups.first_block(group, first_query, self.block_size)

    def _root(self, seq: Sequence) -> BlockHash:
        return root_hash(self.model_id, seq.cache_salt)

    def _block_tokens(self, seq: Sequence, index: int) -> list[int]:
        return seq.token_ids(index * self.block_size, (index + 1) * self.block_size)
