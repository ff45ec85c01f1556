"""Per-sequence block tables on top of the block pool."""

from __future__ import annotations

from workers.engine.block_pool import BlockPool
from workers.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

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

    def free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
