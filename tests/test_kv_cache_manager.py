"""KVCacheManager: block tables grow one block per block_size tokens, all-or-nothing, and
full computed blocks are found again by content (prefix caching)."""

from __future__ import annotations

import pytest

from workers.engine.block_hash import hash_full_blocks, root_hash
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence


def _seq(num_prompt_tokens: int, request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(range(num_prompt_tokens)), SamplingParams())


def _table(seq: Sequence) -> list[int]:
    """The block table of a one-group cache (none before the first allocation)."""
    return seq.block_tables[0] if seq.block_tables else []


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
        before = list(_table(seq))
        assert kv.allocate(seq, 1)
        seq.num_computed_tokens += 1
        crossed = (num_tokens - 1) % block_size == 0
        if crossed:
            assert len(seq.block_tables[0]) == len(before) + 1
            assert seq.block_tables[0][:-1] == before
        else:
            assert seq.block_tables[0] == before
        assert len(seq.block_tables[0]) == -(-num_tokens // block_size)
        assert kv.num_free_blocks == 8 - len(seq.block_tables[0])


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_allocation_matches_token_count(block_size):
    kv = KVCacheManager(num_blocks=8, block_size=block_size)
    seq = _seq(3 * block_size + 1)
    assert kv.allocate(seq, block_size + 1)
    assert len(seq.block_tables[0]) == 2
    seq.num_computed_tokens += block_size + 1
    # block_size - 1 more tokens exactly fill the second block: nothing new needed.
    assert kv.allocate(seq, block_size - 1)
    assert len(seq.block_tables[0]) == 2
    seq.num_computed_tokens += block_size - 1
    assert kv.allocate(seq, block_size + 1)
    assert len(seq.block_tables[0]) == 4
    assert len(set(seq.block_tables[0])) == 4


def test_allocate_zero_tokens_needs_no_block():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    seq = _seq(4)
    assert kv.allocate(seq, 0)
    assert kv.num_held_blocks(seq) == 0
    assert kv.num_free_blocks == 2


def test_allocate_when_short_returns_false_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    other = _seq(8, "other")
    assert kv.allocate(other, 8)
    seq = _seq(8, "seq")
    assert kv.allocate(seq, 2)
    seq.num_computed_tokens = 2
    table = list(seq.block_tables[0])
    assert kv.num_free_blocks == 0
    # 2 computed + 3 new = 5 tokens needs a second block the pool does not have.
    assert not kv.allocate(seq, 3)
    assert seq.block_tables[0] == table
    assert kv.num_free_blocks == 0
    # Asking for less than a block boundary still works with nothing free.
    assert kv.allocate(seq, 2)
    assert seq.block_tables[0] == table


def test_allocate_is_all_or_nothing_for_a_multi_block_request():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    seq = _seq(20)
    # 20 tokens needs 5 blocks; only 4 exist. None must be taken.
    assert not kv.allocate(seq, 20)
    assert kv.num_held_blocks(seq) == 0
    assert kv.num_free_blocks == 4
    assert [kv.pool.ref_count(b) for b in range(4)] == [0, 0, 0, 0]


def test_free_returns_every_block_and_clears_the_table():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, b = _seq(9, "a"), _seq(5, "b")
    assert kv.allocate(a, 9)
    assert kv.allocate(b, 5)
    assert kv.num_free_blocks == 1
    a_blocks = list(a.block_tables[0])
    kv.free(a)
    assert a.block_tables == []
    assert kv.num_free_blocks == 4
    assert all(kv.pool.ref_count(blk) == 0 for blk in a_blocks)
    assert all(kv.pool.ref_count(blk) == 1 for blk in b.block_tables[0])
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
    assert len(b.block_tables[0]) == 2


# -- prefix caching ------------------------------------------------------------


def _prefill(kv: KVCacheManager, seq: Sequence) -> None:
    """What an engine step does: allocate, 'compute' every uncomputed token, commit."""
    assert kv.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.commit_computed_blocks(seq)


def _salted(tokens: list[int], request_id: str, salt: str | None = None) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(), cache_salt=salt)


def test_a_later_sequence_attaches_the_cached_full_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _salted(list(range(10)), "a")
    assert kv.find_cached_prefix(a) == 0
    _prefill(kv, a)
    # b shares a's first 9 tokens: a's two full blocks, not its partial third one.
    b = _salted(list(range(9)) + [99, 98, 97], "b")
    assert kv.find_cached_prefix(b) == 8
    assert b.block_tables[0] == a.block_tables[0][:2]
    assert b.num_computed_tokens == 8
    assert [kv.pool.ref_count(blk) for blk in b.block_tables[0]] == [2, 2]
    # b computes its own blocks after the shared ones.
    assert kv.allocate(b, b.num_uncomputed_tokens)
    assert len(b.block_tables[0]) == 3
    assert b.block_tables[0][2] not in a.block_tables[0]


def test_the_last_token_is_always_left_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _salted(list(range(8)), "a")
    _prefill(kv, a)
    # The same 8 tokens are two full cached blocks, but only the first may be used:
    # the step must compute something to produce logits.
    same = _salted(list(range(8)), "same")
    assert kv.find_cached_prefix(same) == 4
    assert same.num_uncomputed_tokens == 4
    longer = _salted(list(range(9)), "longer")
    assert kv.find_cached_prefix(longer) == 8
    assert longer.num_uncomputed_tokens == 1


def test_only_blocks_whose_kv_is_written_are_cached():
    events = []
    kv = KVCacheManager(num_blocks=16, block_size=4, on_events=lambda s, e: events.append((s, e)))
    a = _salted(list(range(12)), "a")
    assert kv.allocate(a, 6)
    a.num_computed_tokens = 6
    kv.commit_computed_blocks(a)
    kv.flush_events()
    # Block 1 is allocated and half written: not findable yet.
    assert events == [([a.block_hashes[0]], [])]
    assert kv.find_cached_prefix(_salted(list(range(12)), "b")) == 4
    assert kv.allocate(a, 6)
    a.num_computed_tokens = 12
    kv.commit_computed_blocks(a)
    kv.flush_events()
    assert events[1] == (a.block_hashes[1:3], [])
    assert len(a.block_hashes) == 3


def test_sequence_hashes_are_the_shared_hash_function():
    # The router hashes prompts with hash_full_blocks; the engine must agree exactly.
    kv = KVCacheManager(num_blocks=16, block_size=4, model_id="my-model")
    seq = _salted(list(range(3, 21)), "a", salt="tenant")
    _prefill(kv, seq)
    expected = hash_full_blocks(seq.prompt_token_ids, 4, root_hash("my-model", "tenant"))
    assert seq.block_hashes == expected
    assert len(expected) == 4


def test_different_salts_never_share_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(13))
    _prefill(kv, _salted(tokens, "a", salt="tenant-a"))
    assert kv.find_cached_prefix(_salted(tokens, "b", salt="tenant-b")) == 0
    assert kv.find_cached_prefix(_salted(tokens, "c", salt=None)) == 0
    assert kv.find_cached_prefix(_salted(tokens, "d", salt="tenant-a")) == 12


def test_a_different_model_never_shares_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4, model_id="one")
    _prefill(kv, _salted(list(range(13)), "a"))
    kv.model_id = "two"
    assert kv.find_cached_prefix(_salted(list(range(13)), "b")) == 0


def test_lookup_stops_at_the_first_missing_block():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    _prefill(kv, _salted(list(range(16)) + [0], "a"))
    # Block 1 differs, so block 2 cannot be reused even though its tokens match.
    tokens = list(range(16)) + [0]
    tokens[5] = 77
    assert kv.find_cached_prefix(_salted(tokens, "b")) == 4


def test_freed_blocks_stay_findable_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = _salted(list(range(9)), "a")
    _prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = _salted(list(range(9)), "b")
    assert kv.find_cached_prefix(b) == 8
    assert kv.num_free_blocks == 2
    kv.free(b)
    # Something else takes every block: the cache is gone.
    other = _salted([50 + i for i in range(16)], "other")
    assert kv.allocate(other, 16)
    kv.free(other)
    assert kv.find_cached_prefix(_salted(list(range(9)), "c")) == 0


def test_free_queues_a_sequences_tail_for_eviction_before_its_head():
    events = []
    kv = KVCacheManager(num_blocks=3, block_size=4, on_events=lambda s, e: events.append((s, e)))
    a = _salted(list(range(12)), "a")
    _prefill(kv, a)
    kv.flush_events()
    kv.free(a)
    other = _salted([90], "other")
    assert kv.allocate(other, 1)
    kv.flush_events()
    # The last full block goes first; the leading ones, likelier to be shared, stay.
    assert events[-1] == ([], [a.block_hashes[2]])
    assert kv.find_cached_prefix(_salted(list(range(13)), "b")) == 8


def test_lookup_on_a_sequence_that_holds_blocks_is_a_bug():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    seq = _salted(list(range(5)), "a")
    assert kv.allocate(seq, 5)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        kv.find_cached_prefix(seq)


def test_disabled_prefix_caching_never_hashes_or_shares():
    events = []
    kv = KVCacheManager(
        num_blocks=8,
        block_size=4,
        enable_prefix_caching=False,
        on_events=lambda s, e: events.append((s, e)),
    )
    a = _salted(list(range(9)), "a")
    _prefill(kv, a)
    kv.flush_events()
    assert a.block_hashes == []
    assert kv.find_cached_prefix(_salted(list(range(9)), "b")) == 0
    assert events == []
    assert kv.pool.num_cached == 0


def test_events_are_batched_until_flushed():
    events = []
    kv = KVCacheManager(num_blocks=8, block_size=4, on_events=lambda s, e: events.append((s, e)))
    a, b = _salted(list(range(8)), "a"), _salted(list(range(20, 29)), "b")
    _prefill(kv, a)
    _prefill(kv, b)
    assert events == []
    kv.flush_events()
    assert events == [(a.block_hashes + b.block_hashes, [])]
    kv.flush_events()
    assert len(events) == 1  # nothing changed, nothing sent


def test_a_resend_reports_the_whole_cached_set_once_parents_first():
    events = []
    kv = KVCacheManager(num_blocks=3, block_size=4, on_events=lambda s, e: events.append((s, e)))
    a, b = _salted(list(range(8)), "a"), _salted(list(range(20, 28)), "b")
    _prefill(kv, a)
    kv.free(a)
    kv.flush_events()
    _prefill(kv, b)  # the free block, then a's tail: a's root stays cached
    assert kv.pool.num_cached == 3
    kv.resend_cached()
    kv.flush_events()
    # All that is cached, parents first, and the batch's evictions (a's tail), which the
    # listener applies first: it may hold a's tail from earlier batches.
    assert events[-1] == ([a.block_hashes[0], *b.block_hashes], [a.block_hashes[1]])
    kv.flush_events()
    assert len(events) == 2  # once
