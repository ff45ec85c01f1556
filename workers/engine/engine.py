"""The engine: requests in, a step at a time, token and text deltas out.

A serving layer drives it with `add_request`, `step` (until `has_unfinished`
is False), `abort` and `stats`. Everything a request can get wrong is checked
in `add_request`, so a bad request is refused before it is scheduled and can
never break a step that other requests share.

This module builds the engine's parts and takes its requests; the step itself is its
base class `EngineStep` (engine_step.py), and the KV handoff's export, release and
prefetch calls are `KVHandoffAPI` (engine_kv_handoff.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from workers.engine.config import EngineConfig, kv_cache_bytes_per_block
from workers.engine.engine_kv_handoff import KVHandoffAPI
from workers.engine.engine_step import EngineStep
from workers.engine.errors import InvalidRequestError
from workers.engine.handoff import HeldHandoffs, KVImports
from workers.engine.kv_cache_manager import KVCacheManager, KVEventCallback
from workers.engine.kv_transfer import KVHandle, KVLayout
from workers.engine.kv_transport import KVPart
from workers.engine.model_runner import ModelRunner, RunnerSpec
from workers.engine.outputs import EngineStats, RequestOutput
from workers.engine.sampling_params import SamplingParams, check_request
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import FinishReason, Sequence
from workers.engine.speculative import NgramSpeculator
from workers.model.config import ModelConfig
from workers.model.tokenizer import Tokenizer, eos_token_ids
from workers.torch_threads import use_num_threads
from workers.tp.group import TPWorkerGroup


class LLMEngine(EngineStep, KVHandoffAPI):
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
        self.use_thread()
        self.tokenizer = tokenizer or Tokenizer(model_dir)
        self.max_model_len = config.context_length(self.model_config)
        dtype = config.resolved_dtype()
        # The budget is per device: each rank holds its KV heads' slice of every block.
        per_block = kv_cache_bytes_per_block(self.model_config, config.block_size, dtype, tp)
        num_blocks = config.num_blocks(self.model_config)
        self.kv_cache_bytes = num_blocks * per_block * tp  # all ranks together
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
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
        )
        self.runner: ModelRunner | TPWorkerGroup
        if tp == 1:
            self.runner = ModelRunner.from_spec(spec)
        else:
            self.runner = TPWorkerGroup(tp, spec, config.num_threads or 1, config.tp_placement)
        layout = KVLayout.of(self.model_config, config.block_size)
        self.handoffs = HeldHandoffs(
            self.kv, self.runner, layout, tp, config.handoff_timeout_s, config.kv_transport
        )
        self.imports = KVImports(
            self.kv, self.scheduler, self.runner, layout, tp, self.model_config.vocab_size
        )
        # First-token outputs of imported requests, handed out by the next step.
        self._outbox: list[RequestOutput] = []
        self.eos_token_ids = eos_token_ids(
            model_dir, self.model_config.eos_token_ids, self.tokenizer
        )
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
        return Sequence.start(
            request_id,
            prompt,
            params,
            cache_salt,
            self.tokenizer.hf if self.config.detokenize else None,
        )

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

    # -- KV handoff: the decode side (the rest: engine_kv_handoff.py; admitted: engine_step.py)

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
        the ranks compute and set their own."""
        if self.config.num_threads is not None and self.config.tensor_parallel_size == 1:
            use_num_threads(self.config.num_threads)

    def runner_failure(self) -> str | None:
        """Why the TP worker group is unusable, or None. A rank that dies during a KV pull
        (off the engine thread) shows here before any step runs into it."""
        return self.runner.failure if isinstance(self.runner, TPWorkerGroup) else None

    def shutdown(self) -> None:
        """Releases the TP worker processes, if any; the engine is unusable afterwards."""
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
            kv_blocks_reused_for_import=self.imports.num_blocks_reused,
            kv_export_s=self.handoffs.export_s,
            kv_import_s=self.imports.import_s,
            num_draft_tokens=self.speculator.num_draft_tokens if self.speculator else 0,
            num_accepted_draft_tokens=(
                self.speculator.num_accepted_tokens if self.speculator else 0
            ),
        )
