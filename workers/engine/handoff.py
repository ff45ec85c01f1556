"""The engine's two halves of a prefill -> decode KV handoff.

Prefill side (`HeldHandoffs`): a prefill-only request stops after its first
token; its blocks stay allocated (their reference counts kept) until the decode
engine confirms (`release`) or a deadline passes, so an export can be fetched,
and fetched again, in between, but nothing is stranded if decode never comes.

Decode side (`KVImports`): a prefilled request is checked against this engine
(model, layout, prompt hashes), takes what it can from this engine's own prefix
cache at once (those blocks are pinned, so they cannot be evicted while it
waits), and waits in FIFO order for free blocks and a sequence slot; then the
rest is imported and it joins the running batch as if its prompt had been
computed here.

The protocol, as a serving layer drives it:

1. prefill: `add_request(..., prefill_only=True)`, step until its output is
   finished; it carries a `handoff` handle (unless it has a finish_reason: the
   first token ended the request, there is nothing to hand off);
2. decode: `k = cached_prefix_blocks(handle.block_hashes, prompt, cache_salt)`;
3. prefill: `handle, parts = export_kv(request_id, skip_blocks=k)`;
4. decode: `add_prefilled_request(request_id, prompt, params, handle, parts,
   cache_salt)`; on StalePrefixError (decode evicted some of those k blocks
   meanwhile) go back to 3 with `skip_blocks=error.num_cached_blocks`;
5. prefill: `release_handoff(request_id)` (or it expires);
6. decode: step as usual. Its first output repeats the handed-over token (same
   token and text), so a caller that streamed prefill's output skips it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.kv_transfer import KVBlocks, KVHandle, KVLayout, StalePrefixError
from workers.engine.kv_transport import KVPart, KVRef, KVTransferError, check_transport
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence


class BlockRunner(Protocol):
    """The block calls ModelRunner and TPWorkerGroup share."""

    def export_blocks(
        self, block_ids: list[int], start_block: int, transport: str, dst_tp: int | None
    ) -> list[KVPart]: ...

    def prefetch(self, parts: list[KVPart]) -> list[KVPart]:
        """Moves an export's data to where import_blocks reads it (callable from any
        thread); returns the parts to import."""
        ...

    def release_prefetched(self, parts: list[KVPart]) -> None:
        """Frees what prefetch moved, for an export that will not be imported."""
        ...

    def import_blocks(self, block_ids: list[int], parts: list[KVPart], from_block: int) -> None: ...

    def live_exports(self) -> tuple[int, int]:
        """(objects, bytes) exported over a direct transport that importers still hold."""
        ...


@dataclass
class _Held:
    seq: Sequence
    handle: KVHandle
    deadline: float


class HeldHandoffs:
    def __init__(
        self,
        kv: KVCacheManager,
        runner: BlockRunner,
        layout: KVLayout,
        tp_size: int,
        timeout_s: float,
        transport: str,
    ):
        self.kv = kv
        self.runner = runner
        self.layout = layout
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self.transport = transport
        self._held: dict[str, _Held] = {}
        self.num_expired = 0
        self.num_blocks_exported = 0
        self.export_s = 0.0  # time spent copying blocks out, all exports together

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, seq: Sequence, now: float) -> KVHandle:
        """Keeps `seq`'s blocks (it has just sampled its first token) and describes them."""
        if seq.num_computed_tokens != seq.num_prompt_tokens or len(seq.output_token_ids) != 1:
            raise RuntimeError(
                f"{seq.request_id}: a handoff needs exactly the prompt computed and one "
                f"token sampled, got {seq.num_computed_tokens} computed and "
                f"{len(seq.output_token_ids)} sampled"
            )
        bs = self.layout.block_size
        handle = KVHandle(
            request_id=seq.request_id,
            model_id=self.kv.model_id,
            layout=self.layout,
            tp_size=self.tp_size,
            num_tokens=seq.num_prompt_tokens,
            block_hashes=tuple(self.kv.block_hashes(seq, seq.num_prompt_tokens // bs)),
            first_token=seq.output_token_ids[0],
            first_logprob=seq.output_logprobs[0] if seq.output_logprobs else None,
            prompt_logprobs=tuple(seq.prompt_logprobs),
            generator_state=(
                seq.generator.get_state().numpy().tobytes() if seq.generator else None
            ),
            num_cached_tokens=seq.num_cached_tokens,
        )
        self._held[seq.request_id] = _Held(seq, handle, now + self.timeout_s)
        return handle

    def export(
        self,
        request_id: str,
        skip_blocks: int,
        dst_tp: int | None = None,
        transport: str | None = None,
    ) -> tuple[KVHandle, list[KVPart]]:
        """`transport` overrides this engine's for one export (None keeps it)."""
        if transport is not None:
            check_transport(transport)
        held = self._held.get(request_id)
        if held is None:
            raise ValueError(
                f"request_id {request_id!r} holds no KV handoff (never prefill-only, "
                "released, expired or aborted)"
            )
        num_full = len(held.handle.block_hashes)
        if not (isinstance(skip_blocks, int) and 0 <= skip_blocks <= num_full):
            raise ValueError(
                f"skip_blocks must be in [0, {num_full}] (the prompt's full blocks), "
                f"got {skip_blocks!r}"
            )
        heads = self.layout.num_kv_heads
        if dst_tp is not None and not (
            isinstance(dst_tp, int) and dst_tp >= 1 and heads % dst_tp == 0
        ):
            raise ValueError(f"dst_tp must divide the model's {heads} KV heads, got {dst_tp!r}")
        block_ids = held.seq.block_table[skip_blocks : held.handle.num_blocks]
        start = time.perf_counter()
        parts = self.runner.export_blocks(
            block_ids, skip_blocks, transport or self.transport, dst_tp
        )
        self.export_s += time.perf_counter() - start
        self.num_blocks_exported += len(block_ids)
        return held.handle, parts

    def release(self, request_id: str, handle: KVHandle | None = None) -> bool:
        """Frees a handoff's blocks; False if it was unknown (already released or expired),
        or, given `handle`, if the handoff held under that id is another one."""
        held = self._held.get(request_id)
        if held is None or (handle is not None and held.handle is not handle):
            return False
        del self._held[request_id]
        self.kv.free(held.seq)
        return True

    def expire(self, now: float) -> None:
        for request_id in [r for r, h in self._held.items() if h.deadline <= now]:
            self.release(request_id)
            self.num_expired += 1


@dataclass(eq=False)
class _Pending:
    seq: Sequence
    handle: KVHandle
    # The export as it arrived (one part per prefill rank); each of this engine's ranks
    # takes its KV heads from `from_block` on, the blocks it lacks.
    parts: list[KVPart]
    from_block: int


class KVImports:
    def __init__(
        self,
        kv: KVCacheManager,
        scheduler: Scheduler,
        runner: BlockRunner,
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
        cached = self.kv.cached_blocks(hashes, seq.prompt_token_ids, seq.cache_salt)
        start = parts[0].start_block
        if len(cached) < start:
            raise StalePrefixError(
                f"the export skips {start} blocks but this engine now holds only "
                f"{len(cached)} of them; export again with skip_blocks={len(cached)}",
                len(cached),
            )
        self.kv.attach(seq, cached)
        # Its hit rate then tells how much of the handed-over prompts decode already held.
        self.scheduler.count_prefix_lookup(seq.num_prompt_tokens, len(cached) * bs)
        seq.num_cached_tokens = handle.num_cached_tokens
        self.num_blocks_reused += len(cached)
        self.pending.append(_Pending(seq, handle, parts, len(cached)))

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
            held = len(p.seq.block_table)
            if not self.kv.allocate(p.seq, p.handle.num_tokens - p.seq.num_computed_tokens):
                continue
            self.pending.remove(p)
            new_blocks = p.seq.block_table[held:]
            if new_blocks:
                start = time.perf_counter()
                try:
                    self.runner.import_blocks(new_blocks, p.parts, p.from_block)
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
            lay.num_layers,
            2,
            lay.num_kv_heads // src_tp,
            handle.num_blocks - start,
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
                    "(layers, k/v, kv heads of the rank, blocks, block size, head dim)"
                )
