"""One TP rank's slice of a request's KV blocks, as it leaves one process for another.

A prefill engine's TP ranks each export their slice of a request's blocks as one
`KVBlocks`; a decode engine re-splits the slices to its own TP degree and imports them
into blocks of its own. It is plain, picklable data; how it travels (object store, Ray's
tensor transport) is `transport.py`'s business.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch


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
        # byte string and parsed back, a full extra copy each way.
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
