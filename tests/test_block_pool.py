"""BlockPool: allocation, reference counts and the least-recently-freed free queue."""

from __future__ import annotations

import pytest

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
