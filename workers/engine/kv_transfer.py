"""The data of a prefill -> decode KV handoff, and the tensor functions that move it.

A prefill engine holds a request's blocks after its first token and describes
them with a small `KVHandle`; each of its TP ranks exports its slice of those
blocks as one `KVBlocks`. A decode engine re-splits the slices to its own TP
degree and imports them into blocks of its own. Everything here is plain,
picklable data; how the tensors travel (object store, Ray's tensor transport)
is `kv_transport`'s business.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from workers.engine.block_hash import BlockHash
from workers.engine.sampling_params import TokenLogprob
from workers.model.config import ModelConfig
from workers.torch_threads import one_thread


@dataclass(frozen=True)
class KVLayout:
    """What two engines must agree on before one can read the other's blocks."""

    num_layers: int
    num_kv_heads: int  # all ranks together
    head_dim: int
    block_size: int

    @classmethod
    def of(cls, model: ModelConfig, block_size: int) -> KVLayout:
        return cls(model.num_hidden_layers, model.num_key_value_heads, model.head_dim, block_size)


@dataclass(frozen=True)
class KVBlocks:
    """One TP rank's slice of some consecutive blocks of one request.

    `data` is `[num_layers, 2 (k, v), kv_heads_local, num_blocks, block_size, head_dim]`:
    one buffer, so it crosses a process boundary as a single tensor; blocks sit
    where a layer's cache `[kv_heads, num_slots, head_dim]` viewed as
    `[kv_heads, num_blocks, block_size, head_dim]` has them, so export and
    import are one index_select / index_copy_ per layer and tensor; and heads
    come before blocks, so re-splitting heads between TP degrees cuts large
    contiguous runs.
    """

    data: torch.Tensor
    tp_rank: int
    tp_size: int
    # Index of data's first block among the request's blocks (blocks before it
    # were skipped because the importer already holds them).
    start_block: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def num_blocks(self) -> int:
        return self.data.shape[3]

    @property
    def end_block(self) -> int:
        return self.start_block + self.num_blocks

    def cpu(self) -> KVBlocks:
        """In host memory, as Ray's object store carries it."""
        return replace(self, data=self.data.cpu())

    def __reduce__(self) -> tuple[Any, ...]:
        # The data pickles as a numpy array of its bytes (any dtype, bfloat16 included):
        # Ray then carries it out of band, written once into the object store and read
        # in place by the importer. A pickled torch tensor would be serialized into a
        # byte string and parsed back, ~20 ms each way for a 512-token prompt's KV.
        data = self.data.detach().cpu().contiguous()
        raw = data.view(-1).view(torch.uint8).numpy()
        fields = (self.tp_rank, self.tp_size, self.start_block)
        return (_kv_blocks_from_bytes, (raw, data.dtype, self.shape, *fields))


def _kv_blocks_from_bytes(
    raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...], *fields: int
) -> KVBlocks:
    """KVBlocks.__reduce__'s inverse. Out of Ray's object store the array is a read-only
    view of the stored object: the tensor shares it (nothing writes to handoff data; the
    importer copies it into its blocks), hence torch's warning about it is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        data = torch.from_numpy(raw)
    return KVBlocks(data.view(dtype).view(shape), *fields)


@dataclass(frozen=True)
class KVHandle:
    """What a prefill engine hands a decode engine: small, picklable, no tensors.

    `block_hashes` are the prompt's full blocks' hashes (a trailing partial block
    is exported too but has none); the exported blocks cover `num_tokens` prompt
    tokens. The first sampled token's own K/V is not in them: decode computes it
    with its first step.
    """

    request_id: str
    model_id: str
    layout: KVLayout
    tp_size: int  # the prefill engine's TP degree: one KVBlocks per rank
    num_tokens: int
    block_hashes: tuple[BlockHash, ...]
    first_token: int
    first_logprob: TokenLogprob | None = None
    # The prompt's logprobs, if the request asked (prompt_logprobs.py).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # A seeded request's generator after drawing the first token, so decode
    # continues the same random stream a single engine would have.
    generator_state: bytes | None = None
    # Prompt tokens the prefill engine found in its prefix cache, so decode's outputs
    # report the request's usage, not decode's own reuse.
    num_cached_tokens: int = 0

    @property
    def num_blocks(self) -> int:
        """Blocks that hold the prompt's K/V (full ones and a trailing partial one)."""
        return -(-self.num_tokens // self.layout.block_size)


class StalePrefixError(ValueError):
    """The importer no longer holds the leading blocks the export skipped (evicted
    meanwhile); export again with `skip_blocks=num_cached_blocks`."""

    def __init__(self, message: str, num_cached_blocks: int):
        super().__init__(message)
        self.num_cached_blocks = num_cached_blocks

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps the extra field when Ray ships the exception between processes.
        return (type(self), (str(self), self.num_cached_blocks))


class KVCacheHolder(Protocol):
    """What export and import need of a runner (ModelRunner has it)."""

    kv_cache: torch.Tensor  # [layers, k/v, kv heads, slots, head dim]
    block_size: int
    tp_rank: int
    tp_size: int


def _blocked(runner: KVCacheHolder) -> torch.Tensor:
    """The cache as [layers, k/v, kv heads, blocks, block size, head dim]: KVBlocks' layout."""
    layers, two, heads, slots, dim = runner.kv_cache.shape
    size = runner.block_size
    return runner.kv_cache.view(layers, two, heads, slots // size, size, dim)


# Handoff copies run on the calling thread alone. On a machine whose cores a serving
# path and other replicas share, a parallel region waits at its end for a worker the OS
# has taken away: a 2-block export measured 10 ms (p50) in a busy prefill replica on two
# threads against 1 ms on one, and 0.1-0.2 ms either way in a quiet process. A quiet
# process copies a 512-token prompt's 24 MB in ~6 ms on one thread, ~3.5 on two: noise
# next to its prefill.


def export_blocks(
    runner: KVCacheHolder, block_ids: Sequence[int], start_block: int = 0
) -> KVBlocks:
    """Copies blocks `block_ids` of every layer out of `runner`'s cache (on its device)."""
    cache = _blocked(runner)
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
    with one_thread():
        data = cache.index_select(3, ids)
    return KVBlocks(data, runner.tp_rank, runner.tp_size, start_block)


def import_blocks(runner: KVCacheHolder, block_ids: Sequence[int], kv: KVBlocks) -> None:
    """Writes `kv` into blocks `block_ids` of `runner`'s cache, converting device and dtype."""
    if (kv.tp_rank, kv.tp_size) != (runner.tp_rank, runner.tp_size):
        raise ValueError(
            f"KV of TP rank {kv.tp_rank} of {kv.tp_size} cannot go to rank "
            f"{runner.tp_rank} of {runner.tp_size}; take its share with kv_transport.materialize"
        )
    cache = _blocked(runner)
    expected = (*cache.shape[:3], len(block_ids), *cache.shape[4:])
    if tuple(kv.data.shape) != expected:
        raise ValueError(
            f"KV data of shape {tuple(kv.data.shape)} does not fit this rank's cache: "
            f"expected {expected} (layers, k/v, kv heads, blocks, block size, head dim)"
        )
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
    with one_thread():
        cache.index_copy_(3, ids, kv.data.to(device=cache.device, dtype=cache.dtype))
