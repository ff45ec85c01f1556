"""One TP rank's slice of a request's KV blocks, as it leaves one process for another.

A prefill engine's TP ranks each export their slice of a request's blocks as one
`KVBlocks`; a decode engine re-splits the slices to its own TP degree and imports them
into blocks of its own. It is plain, picklable data; how it travels (object store, Ray's
tensor transport) is `transport.py`'s business.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class KVBlocks:
    """One TP rank's slice of the blocks of one request that a handoff moves.

    `data` is `[group_size, 2 (k, v), kv_heads_local, num_blocks, block_size, head_dim]`
    (a block holds one KV-cache group's layers: workers/kv/kv_groups.py): one buffer, so
    it crosses a process boundary as a single tensor; blocks sit where the cache
    `[buffers, k/v, kv_heads, num_slots, head_dim]` viewed as blocks has them, so export
    and import are one index_select / index_copy_; and heads come before blocks, so
    re-splitting heads between TP degrees cuts large contiguous runs. The blocks are
    each group's in turn, those its importer needs (KVLayout.spans).
    """

    data: torch.Tensor
    tp_rank: int
    tp_size: int
    # The request's leading blocks the export skipped (the importer holds them).
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


def select_blocks(data: torch.Tensor, rows: Sequence[int] | None) -> torch.Tensor:
    """Blocks `rows` (indices on the block axis, in order; None: all) of KVBlocks-shaped
    `data`: a view for a run of consecutive blocks, a copy otherwise."""
    if rows is None:
        return data
    rows = list(rows)
    if not all(0 <= r < data.shape[3] for r in rows):
        raise ValueError(f"blocks {rows} are not all among the {data.shape[3]} exported")
    first = rows[0] if rows else 0
    if rows == list(range(first, first + len(rows))):
        return data[:, :, :, first : first + len(rows)]
    return data.index_select(3, torch.tensor(rows, dtype=torch.long, device=data.device))


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
