"""Scheduler: token budget, chunked prefill, ordering and max_num_seqs.

Preemption and `finish` are in test_scheduler_preemption.py, prefix caching at admission in
test_scheduler_prefix_caching.py; the engine's part is played by scheduler_helpers.
"""

from __future__ import annotations

import random

import pytest
from scheduler_helpers import FAKE_TOKEN, _ids, _run_to_completion, _scheduler, _seq, _step

from workers.engine.scheduler import SchedulerConfig


def test_config_rejects_non_positive_limits():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    # Below one token per running sequence, some would sit out whole steps.
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(32\) must be >= max_num_seqs \(64\)"
    ):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)


def test_empty_scheduler_schedules_nothing():
    sched = _scheduler()
    assert not sched.has_work()
    out = sched.schedule()
    assert out.scheduled == []
    assert out.preempted == []
    assert out.num_tokens == 0


def test_short_prompt_prefills_in_one_step_then_decodes_one_token_per_step():
    sched = _scheduler()
    seq = _seq("a", 10, max_tokens=3)
    sched.add(seq)
    out = _step(sched)
    assert _ids(out) == [("a", 10)]
    assert seq.output_token_ids == [FAKE_TOKEN]
    assert _ids(_step(sched)) == [("a", 1)]
    assert _ids(_step(sched)) == [("a", 1)]
    assert seq.finished
    assert seq.output_token_ids == [FAKE_TOKEN] * 3
    assert not sched.has_work()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end():
    sched = _scheduler(budget=16)
    seq = _seq("long", 50, max_tokens=2)
    sched.add(seq)
    chunks, samples = [], []
    while sched.has_work():
        out = sched.schedule()
        (s,) = out.scheduled
        chunks.append(s.num_new_tokens)
        samples.append(s.samples)
        s.seq.num_computed_tokens += s.num_new_tokens
        if samples[-1]:
            seq.output_token_ids.append(FAKE_TOKEN)
            if len(seq.output_token_ids) == 2:
                sched.finish(seq)
    assert chunks == [16, 16, 16, 2, 1]
    assert samples == [False, False, False, True, True]


def test_token_budget_is_never_exceeded():
    rng = random.Random(0)
    budget = 24
    sched = _scheduler(num_blocks=200, block_size=4, budget=budget)
    seqs = [_seq(f"s{i}", rng.randint(1, 60), max_tokens=rng.randint(1, 6)) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    outs = _run_to_completion(sched)
    assert all(0 < o.num_tokens <= budget for o in outs)
    assert all(s.num_new_tokens >= 1 for o in outs for s in o.scheduled)
    # The budget is actually used: the prefill-heavy first step fills it.
    assert outs[0].num_tokens == budget
    assert all(seq.finished for seq in seqs)
    assert all(len(seq.output_token_ids) == seq.params.max_tokens for seq in seqs)


def test_running_sequences_are_scheduled_before_waiting_ones():
    sched = _scheduler(budget=8)
    a, b = _seq("a", 4, max_tokens=10), _seq("b", 4, max_tokens=10)
    sched.add(a)
    sched.add(b)
    assert _ids(_step(sched)) == [("a", 4), ("b", 4)]
    late = _seq("late", 30)
    sched.add(late)
    # Both decodes come first; the newcomer only gets what budget is left.
    assert _ids(_step(sched)) == [("a", 1), ("b", 1), ("late", 6)]
    # The half-prefilled newcomer is now running, and still comes after a and b.
    assert _ids(_step(sched)) == [("a", 1), ("b", 1), ("late", 6)]


def test_waiting_sequence_gets_nothing_when_running_ones_use_the_budget():
    sched = _scheduler(budget=4)  # 4 sequences may run: the budget, not the count, binds
    a, b = _seq("a", 2, max_tokens=5), _seq("b", 10, max_tokens=5)
    sched.add(a)
    sched.add(b)
    assert _ids(_step(sched)) == [("a", 2), ("b", 2)]
    c = _seq("c", 1)
    sched.add(c)
    assert _ids(_step(sched)) == [("a", 1), ("b", 3)]  # b's prefill takes what a leaves
    assert list(sched.waiting) == [c]
    assert c.block_tables == []


def test_an_unfinished_prefill_keeps_its_place_ahead_of_newer_requests():
    sched = _scheduler(budget=16)
    first = _seq("first", 30)
    sched.add(first)
    assert _ids(_step(sched)) == [("first", 16)]
    sched.add(_seq("second", 30))
    assert _ids(_step(sched)) == [("first", 14), ("second", 2)]


def test_max_num_seqs_is_respected():
    sched = _scheduler(max_num_seqs=2)
    seqs = [_seq(f"s{i}", 3, max_tokens=2) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    outs = [_step(sched)]
    assert _ids(outs[0]) == [("s0", 3), ("s1", 3)]
    assert sched.running == seqs[:2]
    assert list(sched.waiting) == seqs[2:]
    outs += _run_to_completion(sched)
    assert all(len(o.scheduled) <= 2 for o in outs)
    assert all(seq.finished for seq in seqs)
    # Requests are admitted in arrival order as slots open up.
    first_seen = []
    for o in outs:
        for s in o.scheduled:
            if s.seq.request_id not in first_seen:
                first_seen.append(s.seq.request_id)
    assert first_seen == [s.request_id for s in seqs]


def test_a_waiting_sequence_refused_blocks_is_not_retried_until_the_pool_gains_some():
    sched = _scheduler(num_blocks=4, block_size=4)
    holder = _seq("holder", 12)  # 3 of the 4 blocks, kept as a held handoff keeps them
    sched.add(holder)
    _step(sched)
    sched.finish(holder, keep_blocks=True)
    blocked = _seq("blocked", 9)  # 3 blocks, 1 free
    sched.add(blocked)
    assert sched.can_schedule()  # not tried yet
    assert sched.schedule().scheduled == []
    assert not sched.can_schedule() and sched.has_work()
    newer = _seq("newer", 1)  # queued behind: the head still cannot go
    sched.add(newer)
    assert not sched.can_schedule()
    sched.kv.free(holder)  # the handoff is released
    assert sched.can_schedule()
    assert _ids(sched.schedule()) == [("blocked", 9), ("newer", 1)]
    assert not sched.waiting and sched.can_schedule()  # both run
