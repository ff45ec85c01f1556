"""The engine's step: the scheduled sequences flattened into the runner's input, its
logits sampled, the picks appended (stop conditions, handoffs held, text released) and
reported as outputs; and between steps, the imported requests admitted into the running
sequences with their handed-over first tokens.

A base class of `LLMEngine`, apart only to keep one concept per module: it works on the
engine's own parts, declared below (built by `LLMEngine.__init__`; requests come in
through `add_request` and `add_prefilled_request` there).
"""

from __future__ import annotations

import time

import torch

from workers.engine import prompt_logprobs
from workers.engine.config import EngineConfig
from workers.engine.handoff import HeldHandoffs, KVImports
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.kv_transfer import KVHandle
from workers.engine.model_runner import ModelRunner, SeqChunk, StepInput
from workers.engine.outputs import RequestOutput, merge_outputs
from workers.engine.sampling_params import TokenLogprob
from workers.engine.scheduler import ScheduledSequence, Scheduler
from workers.engine.sequence import Sequence
from workers.engine.speculative import NgramSpeculator, sample_with_drafts
from workers.tp.group import TPWorkerGroup


class EngineStep:
    config: EngineConfig
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner | TPWorkerGroup
    handoffs: HeldHandoffs
    imports: KVImports
    speculator: NgramSpeculator | None
    eos_token_ids: frozenset[int]
    max_model_len: int
    _generator: torch.Generator
    _outbox: list[RequestOutput]
    _requests: dict[str, Sequence]
    _num_steps: int
    _num_generated: int

    def has_unfinished(self) -> bool:
        """True while `step` has work or outputs to hand out (held handoffs are not work)."""
        return self.scheduler.has_work() or bool(self.imports.pending or self._outbox)

    def needs_step(self) -> bool:
        """True when `step` would compute or hand out something now; False when all that is
        left waits on time or on blocks (held handoffs, imports or requests waiting for
        room), which only a call (abort, release) or a handoff's deadline frees."""
        return self.scheduler.can_schedule() or bool(self._outbox)

    def ready_outputs(self) -> list[RequestOutput]:
        """What is due without computing: the first tokens of imports admitted now. `step`
        hands them out too; a streaming caller takes them first, so that they do not wait
        for the step that computes each request's second token."""
        now = time.monotonic()
        self.handoffs.expire(now)
        self._admit_imports(now)
        outputs, self._outbox = self._outbox, []
        return outputs

    def step(self) -> list[RequestOutput]:
        outputs = self.ready_outputs()
        drafts = self.speculator.propose(self.scheduler.running) if self.speculator else None
        scheduled = self.scheduler.schedule(drafts).scheduled
        if not scheduled:
            self.kv.flush_events()
            return outputs
        sampling = [s for s in scheduled if s.samples]
        output = self.runner.execute(StepInput([self._chunk(s) for s in scheduled]))
        for i, rows in output.prompt_logprobs.items():
            prompt_logprobs.record(scheduled[i].seq, rows)
        logits = output.logits
        for s in scheduled:
            # Drafts count as computed only once accepted (_accept).
            s.seq.num_computed_tokens += s.num_own_tokens
            self.kv.commit_computed_blocks(s.seq)
        self._num_steps += 1
        if not sampling:
            self.kv.flush_events()
            return outputs
        picks = sample_with_drafts(
            logits,
            [(s.seq, s.draft_token_ids) for s in sampling],
            self._generator,
            self.eos_token_ids,
        )
        now = time.monotonic()
        outputs += [self._accept(s, picked, now) for s, picked in zip(sampling, picks, strict=True)]
        if self.imports.pending:
            # Requests that finished here freed blocks and slots: the imports waiting for
            # them go in now, their first tokens out with the next step's outputs.
            self._admit_imports(now)
        self.kv.flush_events()
        return outputs

    def _accept(
        self, s: ScheduledSequence, picked: list[tuple[int, TokenLogprob | None]], now: float
    ) -> RequestOutput:
        """Appends a sampling sequence's picks of this step (sample_with_drafts): each but
        the last equals the draft at its position, whose K/V, computed this step, stays."""
        seq, drafts = s.seq, s.draft_token_ids
        outs = []
        for j, (token, logprob) in enumerate(picked):
            outs.append(self._append_token(seq, token, logprob, now))
            if outs[-1].finished or j == len(picked) - 1:
                break
            seq.num_computed_tokens += 1
            # Now, while seq still holds its blocks: its next token may finish it.
            self.kv.commit_computed_blocks(seq)
        self._num_generated += len(outs)
        if drafts:
            # Accepted: the drafts kept, each pick before the last one (the model's own),
            # up to where a stop ended the request.
            self.speculator.record(seq, len(drafts), min(len(outs), len(picked) - 1))
            if not seq.finished:
                self.kv.trim(seq)
        return outs[0] if len(outs) == 1 else merge_outputs(outs)

    @staticmethod
    def _chunk(s: ScheduledSequence) -> SeqChunk:
        start = s.seq.num_computed_tokens
        offset, targets = prompt_logprobs.due_targets(s.seq, start, s.num_own_tokens)
        return SeqChunk(
            s.seq.token_ids(start, start + s.num_own_tokens) + list(s.draft_token_ids),
            start,
            s.seq.block_table,
            s.samples,
            len(s.draft_token_ids),
            prompt_targets=targets,
            prompt_from=offset,
            prompt_top_n=s.seq.params.prompt_logprobs or 0,
        )

    def _append_token(
        self, seq: Sequence, token: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        reason = seq.append_token(token, logprob, now, self.eos_token_ids, self.max_model_len)
        # A prefill-only request that goes on ends here without a reason: it is not over.
        handing_off = reason is None and seq.prefill_only
        if reason is not None or handing_off:
            seq.finish_reason = reason
            self.scheduler.finish(seq, keep_blocks=handing_off)
            self._requests.pop(seq.request_id, None)
        handoff = self.handoffs.hold(seq, now) if handing_off else None
        # A handoff releases text as a running request would, so the decode engine's
        # first output (the same token) carries the same text.
        text = seq.detokenizer.release(finished=reason is not None) if seq.detokenizer else ""
        return RequestOutput(
            seq.request_id,
            [token],
            text,
            [logprob] if logprob is not None else [],
            finished=reason is not None or handing_off,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            handoff=handoff,
            prompt_logprobs=(
                list(seq.prompt_logprobs)
                if seq.params.prompt_logprobs is not None and len(seq.output_token_ids) == 1
                else None
            ),
        )

    # -- imported requests (added by LLMEngine.add_prefilled_request) --------------

    def _admit_imports(self, now: float) -> None:
        admitted, lost = self.imports.admit(self.config.max_num_seqs)
        self._recompute(lost, now)
        if self.imports.pending and not self.scheduler.running:
            # None fit, and nothing runs that would free blocks: the queued imports'
            # pinned prefixes hold the pool. All but the oldest go on by recompute.
            self._recompute(self.imports.unpin_stuck(), now)
            more, lost = self.imports.admit(self.config.max_num_seqs)
            admitted += more
            self._recompute(lost, now)
        for seq, handle in admitted:
            self._first_token(seq, handle, now)

    def _recompute(self, imports: list[tuple[Sequence, KVHandle]], now: float) -> None:
        """Imports that go on without their KV: the first token now, then the blocks
        freed and the sequence queued to be computed again, as after a preemption."""
        for seq, handle in imports:
            self._first_token(seq, handle, now)
            if not seq.finished:
                self.scheduler.preempt(seq)

    def _first_token(self, seq: Sequence, handle: KVHandle, now: float) -> None:
        """An imported request's first token, sampled by the engine that prefilled it."""
        seq.prompt_logprobs = list(handle.prompt_logprobs)
        self._outbox.append(self._append_token(seq, handle.first_token, handle.first_logprob, now))
