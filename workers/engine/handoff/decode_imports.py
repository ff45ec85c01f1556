"""The decode side of a KV handoff: a prefilled request is checked against this engine
(model, layout, prompt hashes), takes what it can from this engine's own prefix cache at
once (those blocks are pinned, so they cannot be evicted while it waits), and waits in
FIFO order for free blocks and a sequence slot; then the rest is imported and it joins the
running batch as if its prompt had been computed here (the protocol: __init__.py)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from workers.engine.handoff.handle import KVHandle, StalePrefixError
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence
from workers.kv.blocks import KVBlocks
from workers.kv.layout import KVLayout
from workers.kv.transport import KVPart, KVRef, KVTransferError
from workers.runner.runner import Runner


@dataclass(eq=False)
class _Pending:
    seq: Sequence
    handle: KVHandle
    # The export as it arrived (one part per prefill rank); each of this engine's ranks
    # takes its KV heads of the blocks it lacks: those past the `from_block` it holds.
    parts: list[KVPart]
    from_block: int


class DecodeImports:
    def __init__(
        self,
        kv: KVCacheManager,
        scheduler: Scheduler,
        runner: Runner,
        layout: KVLayout,
        tp_size: int,
        vocab_size: int,
    ):
        self.kv = kv
        self.scheduler = scheduler
        self.runner = runner
        self.layout = layout
        self.tp_size = tp_size
        self.vocab_size = vocab_size
        self.pending: deque[_Pending] = deque()
        self.num_blocks_imported = 0
        self.num_blocks_reused = 0
        self.import_s = 0.0  # time spent writing imported blocks, all imports together

    def add(self, seq: Sequence, handle: KVHandle, parts: list[KVPart]) -> None:
        """Checks the handoff against `seq` (its prompt, params and salt, not yet holding
        blocks) and this engine, pins the cached prefix and queues the rest for import.

        Raises ValueError (StalePrefixError when re-exporting would fix it) before
        changing anything.
        """
        self._check_handle(seq, handle)
        bs = self.layout.block_size
        hashes = self.kv.block_hashes(seq, seq.num_prompt_tokens // bs)
        if hashes != list(handle.block_hashes):
            raise ValueError(
                "handle.block_hashes do not match this prompt's blocks under model_id "
                f"{self.kv.model_id!r} and cache_salt {seq.cache_salt!r}"
            )
        self._check_parts(handle, parts)
        if seq.generator is not None and handle.generator_state is not None:
            state = torch.frombuffer(bytearray(handle.generator_state), dtype=torch.uint8)
            try:
                seq.generator.set_state(state)
            except RuntimeError as e:
                raise ValueError(f"handle.generator_state is not a generator's state: {e}") from e
        cached = self.kv.cached_prefix(hashes, seq.prompt_token_ids, seq.cache_salt)
        have = len(cached[0])
        start = parts[0].start_block
        if have < start:
            raise StalePrefixError(
                f"the export skips {start} blocks but this engine now holds only "
                f"{have} of them; export again with skip_blocks={have}",
                have,
            )
        self.kv.attach(seq, cached)
        # Its hit rate then tells how much of the handed-over prompts decode already held.
        self.scheduler.count_prefix_lookup(seq.num_prompt_tokens, have * bs)
        seq.num_cached_tokens = handle.num_cached_tokens
        self.num_blocks_reused += have
        self.pending.append(_Pending(seq, handle, parts, have))

    def admit(
        self, max_running: int
    ) -> tuple[list[tuple[Sequence, KVHandle]], list[tuple[Sequence, KVHandle]]]:
        """Imports queued handoffs that fit, oldest first, while sequence slots last.
        Returns the sequences now running and those whose transfer failed
        (KVTransferError: their export is gone), which hold their blocks for the caller to
        free and recompute, as after a preemption; each still to be given its first token.

        First fit, not strict FIFO: a waiting import pins its reused blocks, so an
        older import that cannot fit must not block a younger one that can (the
        younger one finishing is what frees room for the older)."""
        admitted, lost = [], []
        for p in list(self.pending):
            if len(self.scheduler.running) >= max_running:
                break
            num_tokens = p.handle.num_tokens
            if not self.kv.allocate_context(p.seq, num_tokens):
                continue
            self.pending.remove(p)
            # Group after group, the blocks this engine lacks (KVLayout.spans), and where
            # each is in the export.
            spans = self.layout.spans(num_tokens, p.from_block)
            tables = p.seq.block_tables
            new_blocks = [b for t, (lo, hi) in zip(tables, spans, strict=True) for b in t[lo:hi]]
            if new_blocks:
                rows = self.layout.import_rows(num_tokens, p.parts[0].start_block, p.from_block)
                start = time.perf_counter()
                try:
                    self.runner.import_blocks(new_blocks, p.parts, rows)
                except KVTransferError:
                    # Pulled here, not prefetched, from an exporter gone since: the
                    # request is this engine's to finish, from its prompt.
                    self.runner.release_prefetched(p.parts)
                    lost.append((p.seq, p.handle))
                    continue
                self.import_s += time.perf_counter() - start
            else:  # this engine cached every block meanwhile: the export is not needed
                self.runner.release_prefetched(p.parts)
            self.num_blocks_imported += len(new_blocks)
            p.seq.num_computed_tokens = p.handle.num_tokens
            self.kv.commit_computed_blocks(p.seq)
            self.scheduler.add_running(p.seq)
            admitted.append((p.seq, p.handle))
        return admitted, lost

    def unpin_stuck(self) -> list[tuple[Sequence, KVHandle]]:
        """Every queued import but the oldest, taken out of the queue with its prefetched
        KV released: for when none of them fit and nothing runs that would free blocks,
        as the prefixes they pin can hold the pool between them. The caller frees their
        blocks and has them recomputed, as after a preemption; the oldest then fits."""
        keep, *stuck = self.pending
        self.pending = deque([keep])
        for p in stuck:
            self.runner.release_prefetched(p.parts)
        return [(p.seq, p.handle) for p in stuck]

    def discard(self, seq: Sequence) -> None:
        """Forgets a queued handoff (aborted) and anything prefetched for it; its pinned
        blocks are freed by the caller."""
        for p in self.pending:
            if p.seq is seq:
                self.runner.release_prefetched(p.parts)
        self.pending = deque(p for p in self.pending if p.seq is not seq)

    def _check_handle(self, seq: Sequence, handle: KVHandle) -> None:
        if not isinstance(handle, KVHandle):
            raise ValueError(f"handle must be a KVHandle, got {type(handle).__name__}")
        mismatches = [
            (name, got, want)
            for name, got, want in [
                ("request_id", handle.request_id, seq.request_id),
                ("model_id", handle.model_id, self.kv.model_id),
                ("layout", handle.layout, self.layout),
                ("num_tokens", handle.num_tokens, seq.num_prompt_tokens),
            ]
            if got != want
        ]
        if mismatches:
            name, got, want = mismatches[0]
            raise ValueError(f"handle.{name} is {got!r} but this engine and prompt need {want!r}")
        first = handle.first_token
        if (
            isinstance(first, bool)
            or not isinstance(first, int)
            or not 0 <= first < self.vocab_size
        ):
            raise ValueError(
                f"handle.first_token must be in [0, {self.vocab_size}), got {handle.first_token}"
            )
        lp = handle.first_logprob
        if lp is not None and lp.token_id != handle.first_token:
            raise ValueError(
                f"handle.first_logprob is for token {lp.token_id}, not {handle.first_token}"
            )
        if seq.params.prompt_logprobs is not None:
            # Checked here: an import lacking them would have decode's next step ask for
            # prompt positions it never computes (prompt_logprobs.py), a broken engine.
            got = [lp.token_id for lp in handle.prompt_logprobs]
            if got != seq.prompt_token_ids[1:]:
                raise ValueError(
                    f"handle.prompt_logprobs covers {len(got)} prompt tokens, not the "
                    f"{seq.num_prompt_tokens - 1} after the first this request asked for "
                    "(a prefill engine must compute them with the same SamplingParams)"
                )

    def _check_parts(self, handle: KVHandle, parts: list[KVPart]) -> None:
        """Shapes checked here, so a bad import never reaches (and kills) a TP rank."""
        if not (
            isinstance(parts, list)
            and parts
            and all(isinstance(p, (KVBlocks, KVRef)) for p in parts)
        ):
            raise ValueError(
                "kv_parts must be a list of KVBlocks or KVRef, one per prefill TP rank"
            )
        if len(parts) != handle.tp_size:
            raise ValueError(
                f"kv_parts has {len(parts)} entries for a prefill TP degree of {handle.tp_size}"
            )
        lay, src_tp = self.layout, handle.tp_size
        if lay.num_kv_heads % src_tp:
            raise ValueError(
                f"handle.tp_size={src_tp} does not divide the {lay.num_kv_heads} KV heads"
            )
        start = parts[0].start_block
        if not 0 <= start <= len(handle.block_hashes):
            raise ValueError(
                f"kv_parts start at block {start}; only the prompt's "
                f"{len(handle.block_hashes)} full blocks can be skipped"
            )
        shape = (
            lay.groups.group_size,
            2,
            lay.num_kv_heads // src_tp,
            lay.num_export_blocks(handle.num_tokens, start),
            lay.block_size,
            lay.head_dim,
        )
        for rank, p in enumerate(parts):
            if (p.tp_rank, p.tp_size, p.start_block) != (rank, src_tp, start):
                raise ValueError(
                    f"kv_parts[{rank}] is rank {p.tp_rank} of {p.tp_size} from block "
                    f"{p.start_block}; expected rank {rank} of {src_tp} from block {start}"
                )
            if p.shape != shape:
                raise ValueError(
                    f"kv_parts[{rank}] has shape {p.shape}, expected {shape} "
                    "(layers of a KV-cache group, k/v, kv heads of the rank, blocks of "
                    "every group, block size, head dim)"
                )
