"""The prefill side of a KV handoff: a prefill-only request stops after its first token;
its blocks stay allocated (their reference counts kept) until the decode engine confirms
(`release`) or a deadline passes, so an export can be fetched, and fetched again, in
between, but nothing is stranded if decode never comes (the protocol: __init__.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from workers.engine.handoff.handle import KVHandle
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.sequence import Sequence
from workers.kv.layout import KVLayout
from workers.kv.transport import KVPart, check_transport
from workers.model.config import kv_shards
from workers.runner.runner import Runner


@dataclass
class _Held:
    seq: Sequence
    handle: KVHandle
    deadline: float


class PrefillExports:
    def __init__(
        self,
        kv: KVCacheManager,
        runner: Runner,
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
        self.num_blocks_exported_all_layers = 0
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
        if dst_tp is not None:
            if not (isinstance(dst_tp, int) and dst_tp >= 1):
                raise ValueError(f"dst_tp must be a TP degree (1 or more), got {dst_tp!r}")
            try:
                # Cut for the importer's KV-head shares, not its ranks (replicas share).
                dst_tp = kv_shards(heads, dst_tp)
            except ValueError as e:
                raise ValueError(f"dst_tp={dst_tp}: {e}") from None
        # Group after group, the blocks decode lacks: past skip_blocks, and of a sliding
        # group only those its window reaches from the next token (KVLayout.spans).
        tables = held.seq.block_tables
        spans = self.layout.spans(held.handle.num_tokens, skip_blocks)
        block_ids = [b for table, (lo, hi) in zip(tables, spans, strict=True) for b in table[lo:hi]]
        if min(block_ids, default=0) < 0:
            raise RuntimeError(f"{request_id}: a handoff block behind its window was let go")
        start = time.perf_counter()
        parts = self.runner.export_blocks(
            block_ids, skip_blocks, transport or self.transport, dst_tp
        )
        self.export_s += time.perf_counter() - start
        self.num_blocks_exported += len(block_ids)
        # What the same export would move if every layer kept the whole context.
        unwindowed = (held.handle.num_blocks - skip_blocks) * len(spans)
        self.num_blocks_exported_all_layers += unwindowed
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
