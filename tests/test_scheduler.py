"""Scheduler: token budget, chunked prefill, ordering, max_num_seqs and preemption.

The tests play the engine's part: after each `schedule()` every scheduled sequence
gets its `num_new_tokens` computed, and one that `samples` gets a fake output token
(finishing once it has `max_tokens` of them).
"""

from __future__ import annotations

import random

import pytest

from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from workers.engine.sequence import Sequence, SequenceStatus

FAKE_TOKEN = 7


def _seq(request_id: str, num_prompt_tokens: int, max_tokens: int = 4) -> Sequence:
    return Sequence(
        request_id, list(range(num_prompt_tokens)), SamplingParams(max_tokens=max_tokens)
    )


def _scheduler(
    num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 64, budget: int = 1024
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        KVCacheManager(num_blocks, block_size),
    )


def _step(sched: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, 'run' the model, append sampled tokens, retire finished."""
    out = sched.schedule()
    for s in out.scheduled:
        samples = s.samples  # evaluated before the bookkeeping below changes it
        s.seq.num_computed_tokens += s.num_new_tokens
        if samples:
            s.seq.output_token_ids.append(FAKE_TOKEN)
            if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                sched.finish(s.seq)
    return out


def _ids(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def _check_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    held = [b for seq in sched.running for b in seq.block_table]
    assert len(held) == len(set(held)), "a block is in two block tables"
    assert kv.num_free_blocks + len(held) == kv.num_blocks
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) >= kv.blocks_for_tokens(seq.num_computed_tokens)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.block_table == []
    assert len(sched.running) <= sched.config.max_num_seqs


def _run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_work():
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(_step(sched))
        _check_invariants(sched)
    return outs


def test_config_rejects_non_positive_limits():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)


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
    sched = _scheduler(budget=2)
    a, b = _seq("a", 2, max_tokens=5), _seq("b", 1, max_tokens=5)
    sched.add(a)
    assert _ids(_step(sched)) == [("a", 2)]
    sched.add(b)
    assert _ids(_step(sched)) == [("a", 1), ("b", 1)]
    c = _seq("c", 1)
    sched.add(c)
    assert _ids(_step(sched)) == [("a", 1), ("b", 1)]
    assert list(sched.waiting) == [c]
    assert c.block_table == []


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
    assert c.block_table == []
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
    assert a.block_table == []
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


# -- prefix caching at admission -------------------------------------------------


def _caching_step(sched: Scheduler) -> SchedulerOutput:
    """`_step`, plus registering finished blocks in the prefix cache as the engine does."""
    out = sched.schedule()
    for s in out.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.kv.commit_computed_blocks(s.seq)
        if samples:
            s.seq.output_token_ids.append(FAKE_TOKEN)
            if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                sched.finish(s.seq)
    return out


def _check_shared_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    tables = [seq.block_table for seq in sched.running]
    held = {b for table in tables for b in table}
    # Shared blocks are counted once per holder, and nothing else holds a block.
    for b in range(kv.num_blocks):
        assert kv.pool.ref_count(b) == sum(table.count(b) for table in tables)
    assert kv.num_free_blocks + len(held) == kv.num_blocks
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0


def _prompted(request_id: str, tokens: list[int], max_tokens: int = 2) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens))


def test_admission_with_a_cache_hit_schedules_only_the_rest():
    sched = _scheduler(block_size=4)
    first = _prompted("first", list(range(10)))
    sched.add(first)
    _caching_step(sched)
    second = _prompted("second", list(range(9)) + [50, 51])
    sched.add(second)
    first_blocks = list(first.block_table)
    out = _caching_step(sched)
    assert _ids(out) == [("first", 1), ("second", 3)]
    assert second.output_token_ids == [FAKE_TOKEN]  # the 3 tokens reached the end: sampled
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first_blocks[:2]
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (10 + 11, 8)
    _check_shared_invariants(sched)
    _run_to_completion_shared(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_hit_spends_less_of_the_token_budget():
    sched = _scheduler(block_size=4, budget=8)
    sched.add(_prompted("warm", list(range(16)), max_tokens=1))
    _run_to_completion_shared(sched)
    sched.add(_prompted("a", list(range(16)) + [1]))
    sched.add(_prompted("b", [9] * 6))
    # a needs only its last token; b fits into the budget beside it.
    assert _ids(_caching_step(sched)) == [("a", 1), ("b", 6)]


def test_failed_admission_gives_back_the_blocks_the_lookup_attached():
    sched = _scheduler(num_blocks=4, block_size=4)
    sched.add(_prompted("warm", list(range(8)), max_tokens=1))
    _run_to_completion_shared(sched)
    hog = _prompted("hog", [70] * 5, max_tokens=10)
    sched.add(hog)
    _caching_step(sched)
    # Needs 2 cached blocks + 2 new ones; only the 2 cached ones are free, so it waits.
    late = _prompted("late", list(range(8)) + [5] * 8)
    sched.add(late)
    assert _ids(_caching_step(sched)) == [("hog", 1)]
    assert list(sched.waiting) == [late]
    assert late.block_table == [] and late.num_computed_tokens == 0
    assert sched.prefix_cache_queries == 8 + 5  # the failed attempt is not counted
    _check_shared_invariants(sched)
    assert sched.kv.num_free_blocks == 2  # the cached blocks are free again, still cached
    sched.finish(hog)
    assert _ids(_caching_step(sched)) == [("late", 8)]
    assert late.num_cached_tokens == 8


def test_a_preempted_sequence_finds_its_own_blocks_again():
    # 6 blocks of 4 tokens; a and b hold 2 each, then both grow until one must go.
    sched = _scheduler(num_blocks=6, block_size=4)
    a = _prompted("a", list(range(8)), max_tokens=8)
    b = _prompted("b", list(range(100, 108)), max_tokens=8)
    sched.add(a)
    sched.add(b)
    _caching_step(sched)
    for _ in range(10):
        out = _caching_step(sched)
        _check_shared_invariants(sched)
        if out.preempted:
            break
    assert out.preempted == [b]
    assert b.block_table == []
    # b's freed blocks stay cached, but a's next block took the newest of them (a
    # sequence's tail is evicted first). Once a is done, b is readmitted and recomputes
    # only what is not cached.
    while not a.finished:
        _caching_step(sched)
    known = b.num_tokens
    out = _caching_step(sched)
    assert _ids(out) == [("b", known - 8)]
    assert b.num_computed_tokens == known
    assert b.num_cached_tokens == 0  # what the prompt found when it first arrived
    assert sched.prefix_cache_hits == 8


def test_all_blocks_are_free_after_a_busy_shared_prefix_workload():
    rng = random.Random(2)
    sched = _scheduler(num_blocks=14, block_size=4, max_num_seqs=6, budget=20)
    system = list(range(200, 212))
    seqs = []
    for i in range(30):
        tail = [rng.randint(0, 50) for _ in range(rng.randint(1, 8))]
        seqs.append(_prompted(f"s{i}", system[: rng.choice([4, 8, 12])] + tail, rng.randint(1, 9)))
    pending = list(seqs)
    steps = 0
    while pending or sched.has_work():
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add(pending.pop(0))
        _caching_step(sched)
        _check_shared_invariants(sched)
        steps += 1
        assert steps < 5_000
    assert sched.num_preemptions > 0, "workload was meant to exercise preemption"
    assert sched.prefix_cache_hits > 0
    assert all(seq.finished for seq in seqs)
    assert all(len(seq.output_token_ids) == seq.params.max_tokens for seq in seqs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert all(sched.kv.pool.ref_count(b) == 0 for b in range(sched.kv.num_blocks))


def _run_to_completion_shared(sched: Scheduler) -> None:
    for _ in range(10_000):
        if not sched.has_work():
            return
        _caching_step(sched)
        _check_shared_invariants(sched)
    raise AssertionError("scheduler made no progress")
