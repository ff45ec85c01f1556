"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Every sequence is described by how many of its tokens are already in the KV
cache; a step gives each scheduled sequence some more. A decode is simply one
new token, a prefill chunk is many, so both share a step. Running sequences
go first, in arrival order; when the pool runs dry the newest running sequence
is preempted (its blocks freed, to be recomputed later) rather than failing.

A waiting sequence is looked up in the prefix cache when it is admitted, so it
starts with the cached run of its leading blocks already computed; a preempted
sequence is readmitted the same way and may find its own blocks still cached.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Each running sequence takes at least one token of a step's budget: past the
            # budget, sequences would sit out steps, and later ones wait for earlier ones
            # to finish whole.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}); raise it or lower max_num_seqs"
            )


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # drafts included
    # Speculated tokens computed after the sequence's own (speculative.py).
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_own_tokens(self) -> int:
        """The sequence's own tokens this step computes (drafts excluded)."""
        return self.num_new_tokens - len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so it yields logits."""
        return self.seq.num_computed_tokens + self.num_own_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # The waiting sequence last refused blocks at admission, and the free blocks then:
        # until the pool gains some, trying it again would fail again (can_schedule).
        self._refused: tuple[Sequence, int] | None = None
        # Tokens looked up in the prefix cache at admission, and how many were found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_schedule(self) -> bool:
        """True when `schedule` may schedule something now: sequences run, or the first
        waiting one was not refused blocks since the pool last gained some. False while
        it waits on blocks that only a release, an abort or an expiry frees."""
        if self.running:
            return True
        if not self.waiting:
            return False
        if self._refused is None:
            return True
        seq, num_free = self._refused
        return seq is not self.waiting[0] or self.kv.num_free_blocks > num_free

    def schedule(self, drafts: Mapping[Sequence, list[int]] | None = None) -> SchedulerOutput:
        """This step's work. `drafts`: speculated tokens of decoding sequences, added
        after their own token from what budget and free blocks the step's own work
        leaves, so speculation never costs a sequence its place."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate(seq, n):
                victim = self.running.pop()
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, n))
                budget -= n
                i += 1
                continue
            break

        # Admitting new work while evicting old would only thrash the pool.
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                cached = self.kv.find_cached_prefix(seq)
                n = min(seq.num_uncomputed_tokens, budget)
                if not self.kv.allocate(seq, n):
                    # Give back what the lookup attached; the next attempt looks again.
                    self.kv.free(seq)
                    seq.num_computed_tokens = 0
                    self._refused = (seq, self.kv.num_free_blocks)
                    break
                self._refused = None
                self.waiting.popleft()
                self._count_prefix_lookup(seq, cached)
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = time.monotonic()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSequence(seq, n))
                budget -= n
        if drafts and not out.preempted:  # a pool short of blocks has none to guess with
            self._add_drafts(out, drafts, budget)
        return out

    def _add_drafts(
        self, out: SchedulerOutput, drafts: Mapping[Sequence, list[int]], budget: int
    ) -> None:
        for k, s in enumerate(out.scheduled):
            if budget <= 0:
                break
            seq = s.seq
            # Slots left in the blocks seq holds and in the free ones, past this step's token.
            room = self.kv.free_token_slots(seq, seq.num_computed_tokens + s.num_new_tokens)
            guess = tuple(drafts.get(seq, ())[: min(budget, room)])
            if not guess:
                continue
            if not self.kv.allocate(seq, s.num_new_tokens + len(guess)):
                raise RuntimeError(f"{seq.request_id}: drafts that fit did not get blocks")
            out.scheduled[k] = ScheduledSequence(seq, s.num_new_tokens + len(guess), guess)
            budget -= len(guess)

    def add_running(self, seq: Sequence) -> None:
        """Takes a sequence whose blocks are filled already (a KV import) straight to running."""
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, keep_blocks: bool = False) -> None:
        """Drops a sequence (finished or aborted) and frees its blocks, unless
        `keep_blocks`: a KV handoff holds them and frees them later."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not keep_blocks:
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

    def count_prefix_lookup(self, num_tokens: int, num_hits: int) -> None:
        """A lookup of `num_tokens` tokens in the prefix cache found `num_hits` of them
        (admission here, or a KV import: each asks this engine's cache)."""
        if self.kv.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hits

    def _count_prefix_lookup(self, seq: Sequence, cached: int) -> None:
        # A preempted sequence finding its own blocks again is no prefix hit: only a
        # first admission counts (as in vLLM), so the rate does not rise with preemptions.
        # Nor is a prompt computed whole for its logprobs a query that missed.
        if (
            not self.kv.enable_prefix_caching
            or seq.num_preemptions
            or seq.params.prompt_logprobs is not None
        ):
            return
        self.count_prefix_lookup(seq.num_tokens, cached)
        seq.num_cached_tokens = cached

    def preempt(self, seq: Sequence) -> None:
        """Frees a sequence's blocks and queues it first, to be recomputed (prompt and
        output so far) when blocks allow."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        # Back to the head of the queue, so it resumes before anything newer.
        self.waiting.appendleft(seq)
