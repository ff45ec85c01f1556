"""What the scheduler tests share: building sequences and schedulers, and playing the engine.

The tests play the engine's part: after each `schedule()` every scheduled sequence
gets its `num_new_tokens` computed, and one that `samples` gets a fake output token
(finishing once it has `max_tokens` of them).
"""

from __future__ import annotations

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
    num_blocks: int = 64, block_size: int = 4, max_num_seqs: int | None = None, budget: int = 1024
) -> Scheduler:
    """By default as many sequences as the budget allows (at least a token each), up to 64."""
    max_num_seqs = max_num_seqs or min(64, budget)
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
    held = [b for seq in sched.running for b in seq.block_tables[0]]
    assert len(held) == len(set(held)), "a block is in two block tables"
    assert kv.num_free_blocks + len(held) == kv.num_blocks
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_tables[0]) >= kv.blocks_for_tokens(seq.num_computed_tokens)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.block_tables == []
    assert len(sched.running) <= sched.config.max_num_seqs


def _run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_work():
        assert len(outs) < max_steps, "scheduler made no progress"
        outs.append(_step(sched))
        _check_invariants(sched)
    return outs
