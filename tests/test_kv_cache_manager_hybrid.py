"""KVCacheManager under a hybrid cache: a sliding group lets go of the blocks its window
has passed while the sequence runs, and a prefix hit needs the full groups' whole prefix
and the sliding groups' last window only."""

from __future__ import annotations

from workers.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence
from workers.kv.kv_groups import KVCacheGroups

BS = 4
# One full-attention group and one with a window of 6 tokens.
GROUPS = KVCacheGroups(((0,), (1,)), (None, 6))


def _kv(num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, groups=GROUPS)


def _seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, tokens, SamplingParams())


def _run(kv: KVCacheManager, seq: Sequence, chunk: int) -> None:
    """Computes seq's known tokens `chunk` at a time, as steps would."""
    kv.find_cached_prefix(seq)
    while seq.num_uncomputed_tokens:
        n = min(chunk, seq.num_uncomputed_tokens)
        assert kv.allocate(seq, n)
        seq.num_computed_tokens += n
        kv.commit_computed_blocks(seq)


def test_sliding_blocks_go_back_to_the_pool_as_the_window_moves():
    kv = _kv()
    seq = _seq(list(range(40)))
    _run(kv, seq, chunk=3)
    full, sliding = seq.block_tables
    assert len(full) == len(sliding) == 10 and NULL_BLOCK not in full
    # The next query (position 40) reads keys 35..40: blocks 8 and 9 (and 10, not yet held).
    assert sliding[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in sliding[8:]
    assert kv.num_held_blocks(seq) == 10 + 2
    assert kv.num_free_blocks == 64 - 12
    kv.free(seq)
    assert kv.num_free_blocks == 64


def test_a_step_s_chunk_holds_its_blocks_until_it_is_computed():
    kv = _kv()
    seq = _seq(list(range(40)))
    kv.find_cached_prefix(seq)
    # One chunk of 40: every query needs its window, so all blocks are held for the step.
    assert kv.allocate(seq, 40)
    assert kv.num_held_blocks(seq) == 20
    seq.num_computed_tokens = 40
    kv.commit_computed_blocks(seq)
    assert kv.num_held_blocks(seq) == 12


def test_allocation_counts_only_the_blocks_a_window_needs():
    # 12 blocks: a 40-token context in steps of 4 needs 10 full + 3 sliding at most,
    # where an all-full allocation would need 20.
    kv = _kv(num_blocks=13)
    seq = _seq(list(range(40)))
    _run(kv, seq, chunk=4)
    assert kv.num_held_blocks(seq) == 12


def test_a_hit_needs_the_whole_full_prefix_and_the_last_window():
    kv = _kv()
    tokens = list(range(40))
    first = _seq(tokens, "a")
    _run(kv, first, chunk=40)  # every block of both groups computed and registered
    kv.free(first)
    again = _seq(tokens, "b")
    # 9 usable blocks (the last token is computed again); all cached in both groups.
    assert kv.find_cached_prefix(again) == 9 * BS
    full, sliding = again.block_tables
    # From position 36 the window reaches back to key 31: blocks 7 and 8 only.
    assert len(full) == 9 and sliding == [NULL_BLOCK] * 7 + sliding[7:]
    assert NULL_BLOCK not in sliding[7:]


def test_a_hit_stops_where_the_sliding_group_lacks_its_window():
    kv = _kv()
    tokens = list(range(40))
    first = _seq(tokens, "a")
    _run(kv, first, chunk=40)
    # Lose the sliding group's blocks 7 and 8 (as eviction would).
    hashes = kv.block_hashes(first, 9)
    kv.free(first)
    for i in (7, 8):
        kv.pool._evict(
            kv.pool.cached_block((1, hashes[i]), hashes[i - 1], tokens[i * 4 : i * 4 + 4])
        )
    again = _seq(tokens, "b")
    # A prefix of 7 blocks (window back to key 23: blocks 5, 6) is the longest held.
    assert kv.find_cached_prefix(again) == 7 * BS
    assert again.block_tables[1][:5] == [NULL_BLOCK] * 5


def test_an_import_takes_only_the_window_of_a_sliding_group():
    kv = _kv()
    seq = _seq(list(range(40)))
    kv.find_cached_prefix(seq)
    assert kv.allocate_context(seq, 40)
    full, sliding = seq.block_tables
    assert len(full) == 10 and NULL_BLOCK not in full
    assert sliding[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in sliding[8:]


def test_only_the_primary_group_s_blocks_are_reported():
    events = []
    kv = KVCacheManager(64, BS, groups=GROUPS, on_events=lambda s, e: events.append((s, e)))
    seq = _seq(list(range(9)))
    _run(kv, seq, chunk=9)
    kv.flush_events()
    assert [len(stored) for stored, _ in events] == [2]
    assert events[0][0] == kv.block_hashes(seq, 2)


def test_drafts_may_take_the_slots_one_block_per_group_allows():
    kv = _kv(num_blocks=4)
    seq = _seq(list(range(3)))
    kv.find_cached_prefix(seq)
    assert kv.allocate(seq, 3)  # one block per group; 2 left: one more per group
    assert kv.free_token_slots(seq, 3) == 1 + BS
