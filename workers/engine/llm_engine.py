"""The engine: requests in, a step at a time, token and text deltas out.

A serving layer drives it with `add_request`, `step` (until `has_unfinished`
is False), `abort` and `stats`. Everything a request can get wrong is checked
in `add_request`, so a bad request is refused before it is scheduled and can
never break a step that other requests share.

The engine owns its parts and composes them: the scheduler (which sequences run this
step, over the KV cache manager's blocks), the runner (the model, in this process or
as a TP worker group), the prefill side of the KV handoff (`PrefillExports`: requests
held for export), its decode side (`DecodeImports`: prefilled requests waiting for
blocks) and the n-gram speculator. A step flattens the scheduled sequences into the
runner's input, samples its logits, and appends the picks (stop conditions, handoffs
held, text released); between steps, imported requests join the running sequences with
their handed-over first tokens.

Not thread-safe: one thread steps it (`AsyncEngine`'s engine thread, in a server).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import torch

from workers.engine import prompt_logprobs
from workers.engine.block_hash import BlockHash
from workers.engine.config import EngineConfig, kv_cache_bytes_per_block
from workers.engine.core_share import CoreShare
from workers.engine.grammar_compiler import GrammarCompiler
from workers.engine.handoff.decode_imports import DecodeImports
from workers.engine.handoff.handle import KVHandle
from workers.engine.handoff.prefill_exports import PrefillExports
from workers.engine.kv_cache_manager import KVCacheManager, KVEventCallback
from workers.engine.outputs import EngineStats, RequestOutput, RequestTiming, merge_outputs
from workers.engine.sampling_params import SamplingParams, TokenLogprob, check_request
from workers.engine.scheduler import ScheduledSequence, Scheduler, SchedulerConfig
from workers.engine.sequence import FinishReason, Sequence
from workers.engine.speculative import NgramSpeculator, sample_with_drafts
from workers.engine.token_masks import TokenMasks
from workers.errors import InvalidRequestError
from workers.kv.layout import KVLayout
from workers.kv.transport import KVPart
from workers.model import kernels
from workers.model.config import ModelConfig, kv_shards
from workers.model.tokenizer import Tokenizer, eos_token_ids
from workers.runner.model_runner import ModelRunner
from workers.runner.runner_spec import RunnerSpec
from workers.runner.step_io import SeqChunk, StepInput
from workers.runner.tp_group import TPWorkerGroup
from workers.torch_threads import kernels_apart, use_num_threads


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        on_kv_events: KVEventCallback | None = None,
    ):
        """`on_kv_events(stored, evicted)` hears, once per step, which block hashes the
        prefix cache gained and lost, for publishing to the prefix registry. It runs inside
        `step`, so it must be quick and must not raise (hand the batch off, don't await it).
        """
        self.config = config
        model_dir = Path(config.model)
        self.model_config = ModelConfig.from_pretrained(model_dir)
        tp = config.tensor_parallel_size
        self.model_config.check_tp_degree(tp)
        # Threads "auto": each step takes the engine's share of the machine's cores.
        self.cores = CoreShare() if config.num_threads == "auto" else None
        self.use_thread()
        self.tokenizer = tokenizer or Tokenizer(model_dir)
        self.max_model_len = config.context_length(self.model_config)
        dtype = config.resolved_dtype()
        # The budget is per device: each rank holds its KV heads' slice of every block.
        per_block = kv_cache_bytes_per_block(self.model_config, config.block_size, dtype, tp)
        num_blocks = config.num_blocks(self.model_config)
        self.kv_cache_bytes = num_blocks * per_block * tp  # all ranks together
        # What a handoff's two engines must agree on, its KV-cache groups included.
        self.kv_layout = layout = KVLayout.of(self.model_config, config.block_size)
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            groups=layout.groups,
            enable_prefix_caching=config.enable_prefix_caching,
            model_id=config.resolved_model_id(),
            on_events=on_kv_events,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.kv
        )
        spec = RunnerSpec(
            str(model_dir),
            num_blocks,
            config.block_size,
            self.max_model_len,
            dtype,
            config.resolved_device(),
            config.activation_bits,
        )
        self.runner: ModelRunner | TPWorkerGroup
        if tp == 1:
            self.runner = ModelRunner.from_spec(spec)
        else:
            self.runner = TPWorkerGroup(tp, spec, self._rank_threads(), config.tp_placement)
        # A handoff moves one part per KV-head share (ranks replicating a head share one).
        kv_size = kv_shards(self.model_config.num_key_value_heads, tp)
        self.handoffs = PrefillExports(
            self.kv, self.runner, layout, kv_size, config.handoff_timeout_s, config.kv_transport
        )
        self.imports = DecodeImports(
            self.kv, self.scheduler, self.runner, layout, kv_size, self.model_config.vocab_size
        )
        # First-token outputs of imported requests, handed out by the next step.
        self._outbox: list[RequestOutput] = []
        self.eos_token_ids = eos_token_ids(
            model_dir, self.model_config.eos_token_ids, self.tokenizer
        )
        # Structured output: specs compiled once (thread-safe: AsyncEngine compiles a
        # request's off the engine thread before adding it), masks made during the step.
        self.grammars = GrammarCompiler(
            self.tokenizer.hf, self.model_config.vocab_size, self.eos_token_ids
        )
        self.token_masks = TokenMasks(self.grammars.vocab_size)
        self._generator = torch.Generator().manual_seed(config.seed)
        self.speculator = (
            NgramSpeculator(config.speculative, self.max_model_len)
            if config.speculative is not None
            else None
        )
        self._requests: dict[str, Sequence] = {}
        self._num_steps = 0
        self._num_generated = 0

    # -- requests ------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prefill_only: bool = False,
    ) -> None:
        """Queues a request; raises ValueError (naming the field) if it can never run.

        Only requests with the same `cache_salt` share prefix-cache blocks (one salt per
        tenant keeps tenants from observing each other's prompts through timing).

        A `prefill_only` request stops after its first token unless that token ends it:
        that output is finished with no finish_reason and carries a `handoff` handle, and
        the blocks stay held for `export_kv` until `release_handoff` or `handoff_timeout_s`.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params, cache_salt)
        seq.prefill_only = prefill_only
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def _new_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
    ) -> Sequence:
        """A checked request's sequence (not queued yet); ValueError naming a bad field."""
        if request_id in self._requests or request_id in self.handoffs:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        check_request(prompt, params, self.model_config.vocab_size, self.max_model_len, cache_salt)
        if params.stop and not self.config.detokenize:
            raise ValueError(
                "stop strings need an engine that detokenizes (EngineConfig.detokenize=True); "
                "a front end that detokenizes applies them itself"
            )
        seq = Sequence.start(
            request_id,
            prompt,
            params,
            cache_salt,
            self.tokenizer.hf if self.config.detokenize else None,
            self.model_config.vocab_size,
        )
        if params.structured is not None:
            seq.grammar = self.grammars.matcher(params.structured)
            # A resumed request's output so far is where its grammar stands.
            for token in prompt[len(prompt) - params.resumed_tokens :]:
                seq.grammar.accept(token)
        return seq

    def abort(self, request_id: str) -> bool:
        """Drops a request or held handoff, freeing its blocks; False if unknown or done."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return self.handoffs.release(request_id)
        seq.finish_reason = FinishReason.ABORT
        self.imports.discard(seq)
        self.scheduler.finish(seq)
        self._outbox = [o for o in self._outbox if o.request_id != request_id]
        return True

    # -- the step -------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """True while `step` has work or outputs to hand out (held handoffs are not work)."""
        return self.scheduler.has_work() or bool(self.imports.pending or self._outbox)

    def has_timers(self) -> bool:
        """True while held handoffs wait for their deadline or imports wait for blocks:
        a caller that sleeps while nothing needs a step must still wake for them."""
        return bool(self.imports.pending or len(self.handoffs))

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
        if drafts:
            drafts = _grammar_drafts(drafts)
        scheduled = self.scheduler.schedule(drafts).scheduled
        if not scheduled:
            if self.cores is not None:
                self.cores.idle()
            self.kv.flush_events()
            return outputs
        if self.cores is not None:
            self._take_cores()
        chunks = [self._chunk(s) for s in scheduled]
        # A step of a few rows runs in Baton's kernels on their work team, torch's ops on
        # one thread beside it (workers/torch_threads.py).
        small = sum(len(c.token_ids) for c in chunks) <= self.runner.small_step_rows
        with ExitStack() as small_step:
            if small:
                small_step.enter_context(kernels_apart())
                small_step.enter_context(kernels.team_loops())
            return outputs + self._run_step(scheduled, chunks)

    def _run_step(
        self, scheduled: list[ScheduledSequence], chunks: list[SeqChunk]
    ) -> list[RequestOutput]:
        """Runs a scheduled step and samples its tokens; returns their outputs."""
        outputs: list[RequestOutput] = []
        sampling = [s for s in scheduled if s.samples]
        # The grammars' masks are computed while the model runs.
        masks = self.token_masks.start([(s.seq.grammar, s.draft_token_ids) for s in sampling])
        output = self.runner.execute(StepInput(chunks))
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
            masks.result() if masks is not None else None,
        )
        now = time.monotonic()
        outputs += [self._accept(s, picked, now) for s, picked in zip(sampling, picks, strict=True)]
        if self.imports.pending:
            # Requests that finished here freed blocks and slots: the imports waiting for
            # them go in now, their first tokens out with the next step's outputs.
            self._admit_imports(now)
        if self.cores is not None and not self.scheduler.has_work():
            self.cores.idle()
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
            s.seq.block_tables,
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
        ended = reason is not None or handing_off
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
            num_prompt_tokens=seq.num_input_tokens,
            num_output_tokens=seq.num_generated,
            num_cached_tokens=seq.num_cached_tokens,
            handoff=handoff,
            prompt_logprobs=(
                list(seq.prompt_logprobs)
                if seq.params.prompt_logprobs is not None and len(seq.output_token_ids) == 1
                else None
            ),
            timing=_timing(seq, now) if ended else None,
        )

    # -- imported requests (added by add_prefilled_request) --------------------

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

    # -- KV handoff ------------------------------------------------------------

    def export_kv(
        self,
        request_id: str,
        skip_blocks: int = 0,
        dst_tp: int | None = None,
        transport: str | None = None,
    ) -> tuple[KVHandle, list[KVPart]]:
        """Prefill side: a held handoff's handle and its blocks from `skip_blocks` on, one
        part per TP rank in rank order (KVBlocks, or KVRef under a direct transport, cut
        so that each rank of an importer of TP degree `dst_tp` fetches only its heads),
        by `transport` if given, else the engine's; callable again until released."""
        return self.handoffs.export(request_id, skip_blocks, dst_tp, transport)

    def release_handoff(self, request_id: str, handle: KVHandle | None = None) -> bool:
        """Prefill side: frees a handoff's blocks once decode has them; False if unknown.
        With `handle`, only if the held handoff is that one (an id may be used again)."""
        return self.handoffs.release(request_id, handle)

    def cached_prefix_blocks(
        self, block_hashes: list[BlockHash], token_ids: list[int], cache_salt: str | None = None
    ) -> int:
        """Decode side: how many of these leading full blocks this engine's prefix cache
        holds now (a hint for `export_kv`'s `skip_blocks`; nothing is reserved)."""
        return self.kv.num_cached_blocks(list(block_hashes), list(token_ids), cache_salt)

    def prefetch_kv(self, kv_parts: list[KVPart]) -> list[KVPart]:
        """Decode side, callable from any thread while steps run: moves a handoff's blocks
        to where this engine's ranks will import them (under a direct transport each rank
        pulls its own KV heads) and returns the parts to pass to `add_prefilled_request`.
        Raises KVTransferError, leaving nothing behind, if the transfer fails."""
        return self.runner.prefetch(kv_parts)

    def release_prefetched_kv(self, kv_parts: list[KVPart]) -> None:
        """Frees what `prefetch_kv` moved for a handoff that will not be added (any
        thread; a no-op when nothing is held). Aborting an added request frees it too."""
        self.runner.release_prefetched(kv_parts)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        handle: KVHandle,
        kv_parts: list[KVPart],
        cache_salt: str | None = None,
    ) -> None:
        """Decode side: continues a request another engine prefilled, reusing this engine's
        cached leading blocks and importing the rest. The next `step` (or `ready_outputs`)
        imports it once blocks are free and outputs the handed-over first token (stop
        conditions apply: it may finish at once). ValueError when the handle does not fit;
        StalePrefixError when the export skipped blocks no longer held here. Nothing is
        imported here: a failing import is the engine's failure, raised where engine
        failures are (`step`), not a refusal of this request."""
        try:
            seq = self._new_sequence(request_id, prompt_token_ids, params, cache_salt)
            self.imports.add(seq, handle, kv_parts)
        except Exception:
            self.runner.release_prefetched(kv_parts)  # prefetch_kv's pulls will not be used
            raise
        self._requests[request_id] = seq

    def resend_cached_blocks(self) -> None:
        """Any thread: the next step's `on_kv_events` reports every block the prefix cache
        holds, for a listener that lost what it was told (a replaced prefix registry)."""
        self.kv.resend_cached()

    def live_kv_exports(self) -> tuple[int, int]:
        """Prefill side, callable from any thread: (objects, bytes) of exported KV that an
        importer still references, kept outside the KV block budget until it lets go."""
        return self.runner.live_exports()

    # -- convenience ---------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Sequence]:
        """Runs prompts to completion; returns their finished sequences in prompt order."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{self._num_steps}-{i}" for i in range(len(prompts))]
        seqs = []
        try:
            for rid, prompt, p in zip(ids, prompts, per_prompt, strict=True):
                self.add_request(rid, prompt, p)
                seqs.append(self._requests[rid])
        except ValueError:
            for seq in seqs:  # all or nothing: no half of the batch left queued
                self.abort(seq.request_id)
            raise
        while self.has_unfinished():
            self.step()
        return seqs

    def use_thread(self) -> None:
        """Gives the calling thread this engine's torch thread count; call it from any
        thread that will step the engine (workers/torch_threads.py says why). With TP,
        the ranks compute and set their own; with "auto", each step sets its share."""
        if self.config.tensor_parallel_size > 1 or self.config.num_threads is None:
            return
        use_num_threads(self.cores.cores if self.cores else self.config.num_threads)

    def _take_cores(self) -> None:
        """Marks this engine busy in the machine's table and sets the step's threads
        ("auto"): its share of the cores, a one-sequence decode step's included (its
        matrix-vector products split over the threads in a few grabs each; bench/RESULTS.md
        has the measurements). With TP the ranks' counts are fixed; the others still see
        this engine busy."""
        share = self.cores.threads()
        if self.config.tensor_parallel_size == 1:
            use_num_threads(share)

    def _rank_threads(self) -> int:
        """Each TP rank's torch threads: "auto" splits the machine's cores evenly."""
        if self.cores is not None:
            return max(1, self.cores.cores // self.config.tensor_parallel_size)
        return self.config.num_threads or 1

    def runner_failure(self) -> str | None:
        """Why the TP worker group is unusable, or None. A rank that dies during a KV pull
        (off the engine thread) shows here before any step runs into it."""
        return self.runner.failure if isinstance(self.runner, TPWorkerGroup) else None

    def rank_devices(self) -> str | None:
        """The GPUs this engine's TP ranks were given, in CUDA_VISIBLE_DEVICES' syntax as
        their node numbers them ("" for none), or None without TP ranks. Any thread: it
        asks the ranks, not the engine's state."""
        return self.runner.visible_devices() if isinstance(self.runner, TPWorkerGroup) else None

    def shutdown(self) -> None:
        """Releases the TP worker processes, if any; the engine is unusable afterwards."""
        self.token_masks.shutdown()
        if self.cores is not None:
            self.cores.close()
        if isinstance(self.runner, TPWorkerGroup):
            self.runner.shutdown()

    def stats(self) -> EngineStats:
        queries, hits = self.scheduler.prefix_cache_queries, self.scheduler.prefix_cache_hits
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            handoffs_held=len(self.handoffs),
            handoffs_expired=self.handoffs.num_expired,
            imports_waiting=len(self.imports.pending),
            kv_blocks_exported=self.handoffs.num_blocks_exported,
            kv_blocks_imported=self.imports.num_blocks_imported,
            kv_blocks_exported_all_layers=self.handoffs.num_blocks_exported_all_layers,
            kv_blocks_reused_for_import=self.imports.num_blocks_reused,
            kv_export_s=self.handoffs.export_s,
            kv_import_s=self.imports.import_s,
            num_draft_tokens=self.speculator.num_draft_tokens if self.speculator else 0,
            num_accepted_draft_tokens=(
                self.speculator.num_accepted_tokens if self.speculator else 0
            ),
        )


def _grammar_drafts(drafts: dict[Sequence, list[int]]) -> dict[Sequence, list[int]]:
    """Drafts cut to the prefix each sequence's grammar allows (none if it allows none):
    a draft the grammar refuses would never be sampled, so checking it wastes a row."""
    kept = {}
    for seq, tokens in drafts.items():
        if seq.grammar is not None:
            tokens = tokens[: seq.grammar.num_valid(tokens)]
        if tokens:
            kept[seq] = tokens
    return kept


def _timing(seq: Sequence, now: float) -> RequestTiming:
    """The request's time in this engine, ending `now` (appended its last token)."""
    scheduled = seq.first_scheduled_time if seq.first_scheduled_time is not None else now
    first = seq.first_token_time if seq.first_token_time is not None else now
    return RequestTiming(
        queued_s=max(scheduled - seq.arrival_time, 0.0),
        prefill_s=max(first - scheduled, 0.0),
        decode_s=max(now - first, 0.0),
    )
