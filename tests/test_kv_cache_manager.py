"""KVCacheManager: block tables grow one block per block_size tokens, all-or-nothing."""

from __future__ import annotations

import pytest

from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence


def _seq(num_prompt_tokens: int, request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(range(num_prompt_tokens)), SamplingParams())


@pytest.mark.parametrize(
    ("block_size", "tokens", "blocks"),
    [(4, 0, 0), (4, 1, 1), (4, 4, 1), (4, 5, 2), (16, 16, 1), (16, 17, 2), (16, 33, 3)],
)
def test_blocks_for_tokens_rounds_up(block_size, tokens, blocks):
    assert KVCacheManager(8, block_size).blocks_for_tokens(tokens) == blocks


@pytest.mark.parametrize("block_size", [4, 16])
def test_table_grows_only_when_a_block_boundary_is_crossed(block_size):
    kv = KVCacheManager(num_blocks=8, block_size=block_size)
    seq = _seq(1)
    # Grow one token at a time, as decoding does.
    for num_tokens in range(1, 4 * block_size + 1):
        before = list(seq.block_table)
        assert kv.allocate(seq, 1)
        seq.num_computed_tokens += 1
        crossed = (num_tokens - 1) % block_size == 0
        if crossed:
            assert len(seq.block_table) == len(before) + 1
            assert seq.block_table[:-1] == before
        else:
            assert seq.block_table == before
        assert len(seq.block_table) == -(-num_tokens // block_size)
        assert kv.num_free_blocks == 8 - len(seq.block_table)


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_allocation_matches_token_count(block_size):
    kv = KVCacheManager(num_blocks=8, block_size=block_size)
    seq = _seq(3 * block_size + 1)
    assert kv.allocate(seq, block_size + 1)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens += block_size + 1
    # block_size - 1 more tokens exactly fill the second block: nothing new needed.
    assert kv.allocate(seq, block_size - 1)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens += block_size - 1
    assert kv.allocate(seq, block_size + 1)
    assert len(seq.block_table) == 4
    assert len(set(seq.block_table)) == 4


def test_allocate_zero_tokens_needs_no_block():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    seq = _seq(4)
    assert kv.allocate(seq, 0)
    assert seq.block_table == []
    assert kv.num_free_blocks == 2


def test_allocate_when_short_returns_false_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    other = _seq(8, "other")
    assert kv.allocate(other, 8)
    seq = _seq(8, "seq")
    assert kv.allocate(seq, 2)
    seq.num_computed_tokens = 2
    table = list(seq.block_table)
    assert kv.num_free_blocks == 0
    # 2 computed + 3 new = 5 tokens needs a second block the pool does not have.
    assert not kv.allocate(seq, 3)
    assert seq.block_table == table
    assert kv.num_free_blocks == 0
    # Asking for less than a block boundary still works with nothing free.
    assert kv.allocate(seq, 2)
    assert seq.block_table == table


def test_allocate_is_all_or_nothing_for_a_multi_block_request():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    seq = _seq(20)
    # 20 tokens needs 5 blocks; only 4 exist. None must be taken.
    assert not kv.allocate(seq, 20)
    assert seq.block_table == []
    assert kv.num_free_blocks == 4
    assert [kv.pool.ref_count(b) for b in range(4)] == [0, 0, 0, 0]


def test_free_returns_every_block_and_clears_the_table():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, b = _seq(9, "a"), _seq(5, "b")
    assert kv.allocate(a, 9)
    assert kv.allocate(b, 5)
    assert kv.num_free_blocks == 1
    a_blocks = list(a.block_table)
    kv.free(a)
    assert a.block_table == []
    assert kv.num_free_blocks == 4
    assert all(kv.pool.ref_count(blk) == 0 for blk in a_blocks)
    assert all(kv.pool.ref_count(blk) == 1 for blk in b.block_table)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks == 6


def test_free_of_an_empty_table_is_harmless():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    seq = _seq(3)
    kv.free(seq)
    kv.free(seq)
    assert kv.num_free_blocks == 2


def test_freed_blocks_can_serve_another_sequence():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a, b = _seq(8, "a"), _seq(8, "b")
    assert kv.allocate(a, 8)
    assert not kv.allocate(b, 8)
    kv.free(a)
    assert kv.allocate(b, 8)
    assert len(b.block_table) == 2
