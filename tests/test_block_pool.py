"""BlockPool: allocation, reference counts, the least-recently-freed free queue and the cache."""

from __future__ import annotations

import pytest

from workers.engine.block_hash import BlockHash, hash_block, root_hash
from workers.engine.block_pool import BlockPool


def test_fresh_pool_is_all_free():
    pool = BlockPool(5)
    assert pool.num_blocks == 5
    assert pool.num_free == 5
    assert [pool.ref_count(b) for b in range(5)] == [0] * 5


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_needs_at_least_one_block(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_allocate_hands_out_distinct_blocks_with_one_reference():
    pool = BlockPool(8)
    first = pool.allocate(3)
    second = pool.allocate(4)
    assert len(first) == 3
    assert len(second) == 4
    assert len(set(first) | set(second)) == 7
    assert all(0 <= b < 8 for b in first + second)
    assert all(pool.ref_count(b) == 1 for b in first + second)
    assert pool.num_free == 1


def test_allocate_zero_is_a_no_op():
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.num_free == 3


def test_free_drops_the_reference_and_returns_the_block():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free == 4
    assert all(pool.ref_count(b) == 0 for b in blocks)


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(4)
    held = pool.allocate(3)
    with pytest.raises(RuntimeError, match="asked for 2 blocks with only 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert all(pool.ref_count(b) == 1 for b in held)
    # The one block that is left can still be had.
    (last,) = pool.allocate(1)
    assert last not in held
    assert pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_freeing_a_never_allocated_block_raises():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError, match="block 2 freed more often than it is held"):
        pool.free([2])
    assert pool.num_free == 4


def test_double_free_raises_and_keeps_the_queue_intact():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often than it is held"):
        pool.free([blocks[0]])
    # No block was queued twice: the pool still holds exactly its 4 blocks.
    assert pool.num_free == 4
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]


def test_least_recently_freed_blocks_are_reused_first():
    pool = BlockPool(6)
    assert pool.allocate(6) == [0, 1, 2, 3, 4, 5]
    pool.free([4])
    pool.free([1, 5])
    pool.free([0])
    assert pool.allocate(2) == [4, 1]
    pool.free([2])
    # Still-queued blocks (5, 0) come before the block freed just now (2).
    assert pool.allocate(3) == [5, 0, 2]
    assert pool.num_free == 0


def test_blocks_never_allocated_come_before_freed_ones():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a == [0, 1]
    pool.free([1])
    # 2 and 3 were queued from the start, so they are older than the freed 1.
    assert pool.allocate(3) == [2, 3, 1]


def test_num_free_tracks_every_allocate_and_free():
    pool = BlockPool(10)
    held: list[int] = []
    for take, give in [(3, 0), (4, 2), (0, 5), (5, 0), (0, 10)]:
        held += pool.allocate(take)
        pool.free(held[:give])
        held = held[give:]
        assert pool.num_free == 10 - len(held)
        assert sum(pool.ref_count(b) for b in range(10)) == len(held)
    assert held == []


@pytest.mark.parametrize("blocks", [[-1], [3], [0, 0]])
def test_bad_free_is_refused_and_changes_nothing(blocks):
    pool = BlockPool(3)
    pool.allocate(3)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks)
    assert pool.num_free == 0
    assert [pool.ref_count(b) for b in range(3)] == [1, 1, 1]


# -- the content-addressed cache ---------------------------------------------

ROOT = root_hash("m", None)


def _h(*tokens: int) -> BlockHash:
    return hash_block(ROOT, tokens)


def _cache(pool: BlockPool, block: int, *tokens: int) -> BlockHash:
    h = _h(*tokens)
    pool.cache(block, h, ROOT, tokens)
    return h


def test_a_cached_block_survives_its_free_and_can_be_taken_back():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    h = _cache(pool, b, 1, 2)
    pool.free([b])
    assert pool.num_free == 4
    assert pool.cached_block(h, ROOT, (1, 2)) == b
    pool.touch([b])
    assert pool.ref_count(b) == 1
    assert pool.num_free == 3
    # Taken out of the free queue: the next allocations never hand it out.
    assert b not in pool.allocate(3)
    assert pool.take_events() == ([h], [])


def test_a_hit_is_confirmed_by_parent_and_token_ids():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    h = _cache(pool, b, 1, 2)
    assert pool.cached_block(h, ROOT, [1, 2]) == b
    # Same hash, other contents (what a collision would look like): no hit.
    assert pool.cached_block(h, ROOT, [1, 3]) is None
    assert pool.cached_block(h, root_hash("m", "salt"), [1, 2]) is None
    assert pool.cached_block(_h(9), ROOT, [9]) is None


def test_allocation_evicts_cached_blocks_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = [_cache(pool, b, b) for b in blocks]
    pool.take_events()
    pool.free([blocks[2]])
    pool.free([blocks[0], blocks[3]])
    pool.free([blocks[1]])
    assert pool.allocate(1) == [blocks[2]]
    assert pool.take_events() == ([], [hashes[2]])
    assert pool.cached_block(hashes[2], ROOT, [blocks[2]]) is None
    # Reuse refreshes a block: 0 taken back and freed again now queues behind 3 and 1.
    pool.touch([blocks[0]])
    pool.free([blocks[0]])
    assert pool.allocate(2) == [blocks[3], blocks[1]]
    assert pool.take_events() == ([], [hashes[3], hashes[1]])
    assert pool.num_cached == 1


def test_blocks_in_use_are_never_evicted():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    held = _cache(pool, blocks[0], 7)
    pool.free(blocks[1:])
    assert sorted(pool.allocate(2)) == sorted(blocks[1:])
    with pytest.raises(RuntimeError, match="only 0 free"):
        pool.allocate(1)
    assert pool.cached_block(held, ROOT, [7]) == blocks[0]
    assert pool.ref_count(blocks[0]) == 1


def test_touch_shares_a_held_block_and_frees_count_every_holder():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    _cache(pool, b, 4)
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.num_free == 1
    pool.free([b])
    assert pool.num_free == 2
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b])


def test_only_cached_blocks_can_be_shared():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    with pytest.raises(RuntimeError, match="no cached contents"):
        pool.touch([b])


def test_caching_a_block_nobody_holds_is_refused():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="nobody holds it"):
        pool.cache(0, _h(1), ROOT, [1])


def test_a_block_cannot_change_its_hash_while_cached():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    h = _cache(pool, b, 1)
    pool.cache(b, h, ROOT, [1])  # registering the same contents again is a no-op
    with pytest.raises(RuntimeError, match="cannot become"):
        pool.cache(b, _h(2), ROOT, [2])


def test_duplicate_contents_keep_the_first_block():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    h = _cache(pool, a, 5)
    pool.cache(b, h, ROOT, [5])
    assert pool.cached_block(h, ROOT, [5]) == a
    assert pool.num_cached == 1
    # The duplicate was never cached, so reusing it evicts nothing.
    pool.free([b])
    pool.take_events()
    pool.allocate(2)
    assert pool.take_events() == ([], [])


def test_store_and_evict_in_one_batch_cancel_out():
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    h = _cache(pool, b, 1)
    pool.free([b])
    assert pool.allocate(1) == [b]
    assert pool.take_events() == ([], [])
    # Evicted, then stored again (in another block) within one batch: net unchanged.
    h2 = _cache(pool, b, 2)
    pool.take_events()
    pool.free([b])
    pool.allocate(1)
    _cache(pool, b, 2)
    assert pool.take_events() == ([], [])
    assert pool.cached_block(h2, ROOT, [2]) == b
    assert h != h2
