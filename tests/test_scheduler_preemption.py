"""Scheduler: preemption when the pool runs out, and `finish` giving blocks back."""

from __future__ import annotations

import random

from scheduler_helpers import (
    FAKE_TOKEN,
    _check_invariants,
    _ids,
    _run_to_completion,
    _scheduler,
    _seq,
    _step,
)

from workers.engine.sequence import SequenceStatus


def test_newest_running_sequence_is_preempted_when_the_pool_runs_out():
    # 4 blocks of 4 tokens: a (1 block) + b (1 block) + c (2 blocks) fill the pool.
    sched = _scheduler(num_blocks=4, block_size=4)
    a, b, c = _seq("a", 4, max_tokens=3), _seq("b", 4, max_tokens=3), _seq("c", 8, max_tokens=2)
    for seq in (a, b, c):
        sched.add(seq)
    assert _ids(_step(sched)) == [("a", 4), ("b", 4), ("c", 8)]
    assert sched.kv.num_free_blocks == 0
    d = _seq("d", 1)
    sched.add(d)

    # a and b each cross into a second block; c, the newest, gives up its two.
    out = _step(sched)
    assert _ids(out) == [("a", 1), ("b", 1)]
    assert out.preempted == [c]
    assert c.block_tables == []
    assert c.num_computed_tokens == 0
    assert c.status is SequenceStatus.WAITING
    assert c.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert c.output_token_ids == [FAKE_TOKEN]  # generated tokens survive preemption
    assert sched.running == [a, b]
    assert list(sched.waiting) == [c, d]  # back at the head, ahead of newer work
    _check_invariants(sched)

    # Once a and b finish, c recomputes prompt + output in one go and samples again.
    assert _ids(_step(sched)) == [("a", 1), ("b", 1)]
    out = sched.schedule()
    assert _ids(out) == [("c", 9), ("d", 1)]
    assert out.scheduled[0].samples


def test_preemption_of_the_requester_itself_and_no_admission_in_that_step():
    # 4 blocks of 4 tokens, budget 9: step 1 prefills a (4) and the first 5 tokens of v.
    sched = _scheduler(num_blocks=4, block_size=4, budget=9)
    a, v = _seq("a", 4, max_tokens=3), _seq("v", 12, max_tokens=2)
    sched.add(a)
    sched.add(v)
    assert _ids(_step(sched)) == [("a", 4), ("v", 5)]
    assert sched.kv.num_free_blocks == 1

    # a's decode takes the last block; v needs one more, and v is the newest: it goes.
    out = _step(sched)
    assert _ids(out) == [("a", 1)]
    assert out.preempted == [v]
    assert v.num_computed_tokens == 0
    assert list(sched.waiting) == [v]
    # v's next chunk (8 tokens = 2 blocks) would fit in what is free now and in the
    # budget left over, but a step that preempted admits nothing.
    assert sched.kv.num_free_blocks == 2
    assert sched.kv.blocks_for_tokens(min(v.num_uncomputed_tokens, 9 - 1)) == 2

    # The next step resumes it (and a, with its third token, is done).
    assert _ids(_step(sched)) == [("a", 1), ("v", 8)]
    assert v.status is SequenceStatus.RUNNING
    assert a.finished
    _run_to_completion(sched)
    assert a.finished
    assert v.finished
    assert v.num_preemptions == 1
    assert sched.kv.num_free_blocks == 4


def test_preempted_sequences_resume_in_their_original_order():
    # Each sequence holds one full block; the first decode step needs one more each.
    sched = _scheduler(num_blocks=4, block_size=4)
    seqs = [_seq(f"s{i}", 4, max_tokens=2) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    _step(sched)
    out = _step(sched)
    # Nothing is free: s3, then s2 (newest first) are evicted so s0 and s1 can grow.
    assert _ids(out) == [("s0", 1), ("s1", 1)]
    assert out.preempted == [seqs[3], seqs[2]]
    assert list(sched.waiting) == [seqs[2], seqs[3]]
    assert seqs[0].finished and seqs[1].finished
    assert _ids(_step(sched)) == [("s2", 5), ("s3", 5)]


def test_finish_frees_a_running_sequence():
    sched = _scheduler(num_blocks=8, block_size=4)
    a, b = _seq("a", 9, max_tokens=10), _seq("b", 4, max_tokens=10)
    sched.add(a)
    sched.add(b)
    _step(sched)
    assert sched.kv.num_free_blocks == 4
    sched.finish(a)
    assert a.status is SequenceStatus.FINISHED
    assert a.block_tables == []
    assert sched.running == [b]
    assert sched.kv.num_free_blocks == 7
    _check_invariants(sched)


def test_finish_drops_a_waiting_sequence():
    sched = _scheduler(max_num_seqs=1)
    a, b = _seq("a", 4), _seq("b", 4)
    sched.add(a)
    sched.add(b)
    _step(sched)
    assert list(sched.waiting) == [b]
    sched.finish(b)
    assert b.finished
    assert list(sched.waiting) == []
    assert all(s.seq is a for o in _run_to_completion(sched) for s in o.scheduled)


def test_finish_of_a_preempted_sequence_leaves_the_pool_consistent():
    sched = _scheduler(num_blocks=4, block_size=4)
    seqs = [_seq(f"s{i}", 4, max_tokens=5) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    _step(sched)
    out = _step(sched)
    assert out.preempted  # s3 (and s2) are now waiting with no blocks
    for victim in out.preempted:
        sched.finish(victim)
        assert victim.finished
    assert list(sched.waiting) == []
    _check_invariants(sched)
    _run_to_completion(sched)
    assert sched.kv.num_free_blocks == 4


def test_all_blocks_are_free_after_a_busy_workload_with_preemptions():
    rng = random.Random(1)
    sched = _scheduler(num_blocks=12, block_size=4, max_num_seqs=6, budget=20)
    seqs = []
    for i in range(30):
        prompt, max_tokens = rng.randint(1, 20), rng.randint(1, 12)
        assert sched.kv.blocks_for_tokens(prompt + max_tokens) <= 12
        seqs.append(_seq(f"s{i}", prompt, max_tokens=max_tokens))
    # Requests arrive over time, not all at once.
    pending = list(seqs)
    outs = []
    while pending or sched.has_work():
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add(pending.pop(0))
        outs.append(_step(sched))
        _check_invariants(sched)
        assert outs[-1].num_tokens <= 20
        assert len(outs) < 5_000
    assert sched.num_preemptions > 0, "workload was meant to exercise preemption"
    assert sched.num_preemptions == sum(seq.num_preemptions for seq in seqs)
    assert all(seq.finished for seq in seqs)
    assert all(len(seq.output_token_ids) == seq.params.max_tokens for seq in seqs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.running and not sched.waiting
