"""Scheduler: prefix caching at admission (cache hits, the budget, failed admissions)."""

from __future__ import annotations

import random

from scheduler_helpers import FAKE_TOKEN, _ids, _scheduler

from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.engine.sequence import Sequence


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
    tables = [seq.block_tables[0] for seq in sched.running]
    held = {b for table in tables for b in table}
    # Shared blocks are counted once per holder, and nothing else holds a block.
    for b in range(kv.num_blocks):
        assert kv.pool.ref_count(b) == sum(table.count(b) for table in tables)
    assert kv.num_free_blocks + len(held) == kv.num_blocks
    for seq in sched.waiting:
        assert seq.block_tables == [] and seq.num_computed_tokens == 0


def _prompted(request_id: str, tokens: list[int], max_tokens: int = 2) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens))


def test_admission_with_a_cache_hit_schedules_only_the_rest():
    sched = _scheduler(block_size=4)
    first = _prompted("first", list(range(10)))
    sched.add(first)
    _caching_step(sched)
    second = _prompted("second", list(range(9)) + [50, 51])
    sched.add(second)
    first_blocks = list(first.block_tables[0])
    out = _caching_step(sched)
    assert _ids(out) == [("first", 1), ("second", 3)]
    assert second.output_token_ids == [FAKE_TOKEN]  # the 3 tokens reached the end: sampled
    assert second.num_cached_tokens == 8
    assert second.block_tables[0][:2] == first_blocks[:2]
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
    assert late.block_tables == [] and late.num_computed_tokens == 0
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
    assert b.block_tables == []
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
    # Finding its own blocks again is no prefix hit, nor a lookup: only first admissions
    # count, or the hit rate would rise with memory pressure alone.
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (16, 0)


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
