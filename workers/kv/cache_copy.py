"""Copies between a runner's paged KV cache and `KVBlocks`: a handoff's export and import,
one indexed copy per cache tensor."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import torch

from workers.kv.blocks import KVBlocks
from workers.torch_threads import one_thread


class KVCacheHolder(Protocol):
    """What export and import need of a runner (ModelRunner has it)."""

    # [buffers (a KV-cache group's layers), k/v, kv heads, slots, head dim]
    kv_cache: torch.Tensor
    block_size: int
    # The runner's share of the KV heads, of how many (its TP rank and degree unless
    # ranks replicate heads); KVBlocks carry them as their tp_rank / tp_size.
    kv_rank: int
    kv_size: int


def _blocked(runner: KVCacheHolder) -> torch.Tensor:
    """The cache as [buffers, k/v, kv heads, blocks, block size, head dim]: KVBlocks' layout."""
    buffers, two, heads, slots, dim = runner.kv_cache.shape
    size = runner.block_size
    return runner.kv_cache.view(buffers, two, heads, slots // size, size, dim)


# Handoff copies of a few blocks run on the calling thread alone. On a machine whose
# cores a serving path and other replicas share, a parallel region waits at its end for
# a worker the OS has taken away, which costs a busy replica far more than a second
# thread saves on a short prompt's copy (bench/RESULTS.md, "KV handoff: copies and
# transports"). From PARALLEL_COPY_BYTES on, a copy is one region long enough to gain,
# and a long prompt's export and import both sit on its first token's path.
PARALLEL_COPY_BYTES = 4 << 20


def _copy_threads(nbytes: int) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if nbytes >= PARALLEL_COPY_BYTES else one_thread()


def export_blocks(
    runner: KVCacheHolder, block_ids: Sequence[int], start_block: int = 0
) -> KVBlocks:
    """Copies blocks `block_ids` (whichever group's: a block holds all its group's layers)
    out of `runner`'s cache (on its device)."""
    cache = _blocked(runner)
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
    nbytes = cache[:, :, :, :1].numel() * cache.element_size() * len(block_ids)
    with _copy_threads(nbytes):
        data = cache.index_select(3, ids)
    return KVBlocks(data, runner.kv_rank, runner.kv_size, start_block)


def import_blocks(runner: KVCacheHolder, block_ids: Sequence[int], kv: KVBlocks) -> None:
    """Writes `kv` into blocks `block_ids` of `runner`'s cache, converting device and dtype."""
    if (kv.tp_rank, kv.tp_size) != (runner.kv_rank, runner.kv_size):
        raise ValueError(
            f"KV of TP rank {kv.tp_rank} of {kv.tp_size} cannot go to rank "
            f"{runner.kv_rank} of {runner.kv_size}; take its share with transport.materialize"
        )
    cache = _blocked(runner)
    expected = (*cache.shape[:3], len(block_ids), *cache.shape[4:])
    if tuple(kv.data.shape) != expected:
        raise ValueError(
            f"KV data of shape {tuple(kv.data.shape)} does not fit this rank's cache: "
            f"expected {expected} (buffers, k/v, kv heads, blocks, block size, head dim)"
        )
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
    with _copy_threads(kv.data.numel() * cache.element_size()):
        cache.index_copy_(3, ids, kv.data.to(device=cache.device, dtype=cache.dtype))
