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
    assert len(a.block_tables[0]) == 2
    _check_invariants(sched)


def test_drafts_get_only_the_budget_everyone_s_own_tokens_leave():
    sched = _scheduler(num_blocks=16, block_size=4, budget=4)
    a, b = _seq("a", 2, max_tokens=8), _seq("b", 2, max_tokens=8)
    _decoding(sched, a, b)
    out = sched.schedule({a: [1, 2, 3, 4], b: [1, 2]})
    # Both decodes' own tokens first (2 of 4), then a's drafts from the rest.
    assert _ids(out) == [("a", 3), ("b", 1)]
    assert [s.draft_token_ids for s in out.scheduled] == [(1, 2), ()]


def test_drafts_get_only_the_blocks_everyone_s_own_tokens_leave():
    # 8 blocks of 4. Step 1: a's 3-token prompt (1 block) and 17 of b's 24 (5 blocks).
    sched = _scheduler(num_blocks=8, block_size=4, budget=20)
    a, b = _seq("a", 3, max_tokens=8), _seq("b", 24, max_tokens=8)
    sched.add(a)
    sched.add(b)
    _step(sched)
    assert a.num_uncomputed_tokens == 1 and b.num_uncomputed_tokens == 7
    assert sched.kv.num_free_blocks == 2
    # a comes first, but b's prefill chunk takes the block it needs before a's drafts
    # take the last one: 4 of a's 8 drafts fit, and nobody is preempted.
    out = sched.schedule({a: list(range(8))})
    assert out.preempted == []
    assert _ids(out) == [("a", 5), ("b", 7)]
    assert out.scheduled[0].draft_token_ids == (0, 1, 2, 3)
    assert sched.kv.num_free_blocks == 0
    _check_invariants(sched)


def test_no_drafts_in_a_step_that_preempts():
    # 2 blocks of 4: a and b each cross into a second block; b, the newest, is preempted.
    sched = _scheduler(num_blocks=3, block_size=4)
    a, b = _seq("a", 4, max_tokens=8), _seq("b", 4, max_tokens=8)
    _decoding(sched, a, b)
    out = sched.schedule({a: [1, 2], b: [1, 2]})
    assert out.preempted == [b]
    assert [s.draft_token_ids for s in out.scheduled] == [()]
