"""Scheduler: speculated drafts ride after a decode's own token as far as the token budget
and the free blocks allow, and never cost anyone a preemption."""

from __future__ import annotations

from scheduler_helpers import _check_invariants, _ids, _scheduler, _seq, _step


def _decoding(sched, *seqs):
    """Prefills the sequences (one step) so that each decodes next."""
    for seq in seqs:
        sched.add(seq)
    _step(sched)
    assert all(seq.num_uncomputed_tokens == 1 for seq in seqs)


def test_drafts_follow_the_decode_token():
    sched = _scheduler(num_blocks=16, block_size=4)
    a, b = _seq("a", 3, max_tokens=8), _seq("b", 3, max_tokens=8)
    _decoding(sched, a, b)
    out = sched.schedule({a: [5, 6, 7]})
    assert _ids(out) == [("a", 4), ("b", 1)]
    first = out.scheduled[0]
    assert first.draft_token_ids == (5, 6, 7)
    assert first.samples and out.scheduled[1].samples
    # The drafts' slots are allocated: a's 4 tokens + 4 more span 2 blocks.
    assert len(a.block_table) == 2
    _check_invariants(sched)


def test_the_token_budget_trims_drafts_and_comes_first_for_decodes():
    sched = _scheduler(num_blocks=16, block_size=4, budget=4)
    a, b = _seq("a", 2, max_tokens=8), _seq("b", 2, max_tokens=8)
    _decoding(sched, a, b)
    out = sched.schedule({a: [1, 2, 3, 4], b: [1, 2]})
    # a's own token and 2 drafts, then b's own token: the budget of 4 is spent.
    assert _ids(out) == [("a", 3), ("b", 1)]
    assert [s.draft_token_ids for s in out.scheduled] == [(1, 2), ()]


def test_drafts_are_dropped_rather_than_taking_a_block_someone_needs():
    # 4 blocks of 4: a and b hold 1 each (3 tokens + their next); 2 are free.
    sched = _scheduler(num_blocks=4, block_size=4)
    a, b = _seq("a", 3, max_tokens=8), _seq("b", 3, max_tokens=8)
    _decoding(sched, a, b)
    # 3 + 1 + 8 drafts would take both free blocks: none would be left for b.
    out = sched.schedule({a: list(range(8))})
    assert _ids(out) == [("a", 1), ("b", 1)]
    assert out.preempted == [] and out.scheduled[0].draft_token_ids == ()
    _check_invariants(sched)
    # 3 drafts take one block and leave one for b (the last sequence: it may take both).
    sched = _scheduler(num_blocks=4, block_size=4)
    a, b = _seq("a", 3, max_tokens=8), _seq("b", 3, max_tokens=8)
    _decoding(sched, a, b)
    out = sched.schedule({a: [1, 2, 3], b: list(range(8))})
    assert _ids(out) == [("a", 4), ("b", 1)] and out.preempted == []
    assert sched.kv.num_free_blocks == 1  # b's 8 drafts would need 2 more
    _check_invariants(sched)
