"""Per-sequence block tables on top of the block pool, with prefix caching.

Every full block a sequence has computed is registered in the pool under its
chained content hash (`block_hash.py`), so a later sequence that starts with the
same tokens, under the same model and cache salt, attaches those blocks instead
of recomputing them. A shared block is only ever read: a sequence attaches full
blocks and writes its own K/V into blocks after them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from workers.engine.block_hash import BlockHash, hash_block, root_hash
from workers.engine.block_pool import BlockPool
from workers.engine.sequence import Sequence

log = logging.getLogger(__name__)

# Called with (stored, evicted) block hashes, once per batch of changes.
KVEventCallback = Callable[[list[BlockHash], list[BlockHash]], None]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        model_id: str = "model",
        on_events: KVEventCallback | None = None,
    ):
        self.block_size = block_size
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

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> int:
        """Attaches the longest cached run of `seq`'s leading full blocks; returns its tokens.

        The run stops short of the last known token, so the step that follows still
        computes at least one token and so yields logits, and short of the positions
        whose prompt logprobs are still due. `seq.num_computed_tokens`
        becomes the returned count.
        """
        if not self.enable_prefix_caching:
            self.attach(seq, [])
            return 0
        usable = (seq.num_tokens - 1) // self.block_size
        if seq.num_prompt_logprobs_due:  # positions whose logprobs are due must be computed
            usable = min(usable, len(seq.prompt_logprobs) // self.block_size)
        hashes = self.block_hashes(seq, usable)
        self.attach(
            seq,
            self.cached_blocks(hashes, seq.token_ids(0, usable * self.block_size), seq.cache_salt),
        )
        return seq.num_computed_tokens

    def cached_blocks(
        self, block_hashes: list[BlockHash], token_ids: list[int], cache_salt: str | None
    ) -> list[int]:
        """The blocks holding the longest cached run of these leading full blocks (not taken).

        A block counts only if its parent hash and tokens match too (see BlockPool.cached_block).
        """
        if not self.enable_prefix_caching:
            return []
        parent = root_hash(self.model_id, cache_salt)
        blocks: list[int] = []
        for i, h in enumerate(block_hashes):
            tokens = token_ids[i * self.block_size : (i + 1) * self.block_size]
            full = len(tokens) == self.block_size
            block = self.pool.cached_block(h, parent, tokens) if full else None
            if block is None:
                break
            blocks.append(block)
            parent = h
        return blocks

    def attach(self, seq: Sequence, blocks: list[int]) -> None:
        """Gives `seq`, holding nothing yet, these cached blocks as its leading, computed ones."""
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError(
                f"{seq.request_id}: prefix lookup on a sequence that already holds blocks"
            )
        self.pool.touch(blocks)
        seq.block_table = list(blocks)
        seq.num_committed_blocks = len(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grows `seq`'s block table to hold `num_new_tokens` more; False if the pool is short."""
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens) - len(
            seq.block_table
        )
        if needed > self.pool.num_free:
            return False
        if needed > 0:
            seq.block_table.extend(self.pool.allocate(needed))
        return True

    def trim(self, seq: Sequence) -> None:
        """Frees the blocks `seq` holds past its known tokens (slots of rejected drafts)."""
        keep = self.blocks_for_tokens(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:][::-1])
            del seq.block_table[keep:]

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Registers the blocks `seq` has filled completely since the last call.

        Called after a step has written their K/V (`num_computed_tokens` advanced),
        never before: a block is findable only once its contents are real.
        """
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_committed_blocks:
            return
        if full > len(seq.block_table):
            raise RuntimeError(
                f"{seq.request_id}: {full} computed blocks but a table of {len(seq.block_table)}"
            )
        hashes = self.block_hashes(seq, full)
        for i in range(seq.num_committed_blocks, full):
            parent = hashes[i - 1] if i else self._root(seq)
            self.pool.cache(seq.block_table[i], hashes[i], parent, self._block_tokens(seq, i))
        seq.num_committed_blocks = full

    def free(self, seq: Sequence) -> None:
        # Tail first: freed blocks queue for eviction in that order, so a sequence's
        # leading blocks, the ones other requests are likeliest to share, stay longest.
        self.pool.free(seq.block_table[::-1])
        seq.block_table = []
        seq.num_committed_blocks = 0

    def resend_cached(self) -> None:
        """Makes the next flush hand `on_events` every cached block as stored (and what the
        batch evicted, which a listener applies first): the whole state, for a listener
        that lost what it was told (a prefix registry restarted, or one that forgot this
        engine). Callable from any thread: it only sets a flag."""
        self._resend_all = True

    def flush_events(self) -> None:
        """Hands the changes to the cached set since the last flush to `on_events`."""
        stored, evicted = self.pool.take_events()
        if self._resend_all:
            self._resend_all = False
            stored = self.pool.cached_hashes()
        if self.on_events is not None and (stored or evicted):
            try:
                self.on_events(stored, evicted)
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

    def _root(self, seq: Sequence) -> BlockHash:
        return root_hash(self.model_id, seq.cache_salt)

    def _block_tokens(self, seq: Sequence, index: int) -> list[int]:
        return seq.token_ids(index * self.block_size, (index + 1) * self.block_size)
