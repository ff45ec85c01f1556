"""The engine's half of the KV handoff, as its callers see it: a prefill engine exports
and releases held handoffs, a decode engine asks what it holds and moves the blocks over
(the protocol: handoff.py; adding the prefilled request is the engine's, engine.py, and
admitting it into the running sequences its step's, engine_step.py).

A base class of `LLMEngine`, apart only to keep one concept per module: it works on the
engine's own parts, declared below.
"""

from __future__ import annotations

from workers.engine.block_hash import BlockHash
from workers.engine.handoff import HeldHandoffs
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.kv_transfer import KVHandle
from workers.engine.kv_transport import KVPart
from workers.engine.model_runner import ModelRunner
from workers.tp.group import TPWorkerGroup


class KVHandoffAPI:
    kv: KVCacheManager
    runner: ModelRunner | TPWorkerGroup
    handoffs: HeldHandoffs

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
        return len(self.kv.cached_blocks(list(block_hashes), list(token_ids), cache_salt))

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
