"""KV-cache groups: how a model's layers share one pool of blocks (the hybrid KV cache).

Layers that attend alike (the whole context, or one sliding window) form groups of
equal size, `group_size` layers each. A pool block is `block_size` tokens of one
group's layers, and each sequence holds one block table per group. Every group's
layer j reads and writes buffer j of the cache, at its own group's block ids; the
ids never collide, as the pool hands each block to one group at a time.

A full-attention group keeps every block of the context. A sliding group keeps only
the blocks its window still reaches: a query at position p reads keys
p - window + 1 .. p, so once the next query is past them, the blocks before that go
back to the pool. With Gemma 3's five sliding layers to each full one, a long
sequence then holds little more than a sixth of an all-layers-full allocation.

A model whose layers all attend alike is one group of all its layers: a block is
then every layer's, as in a plain paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.model.config import ModelConfig


@dataclass(frozen=True)
class KVCacheGroups:
    # Per group: its layers, in layer order, and its window (None: the whole context).
    layers: tuple[tuple[int, ...], ...]
    windows: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if not self.layers or len(self.layers) != len(self.windows):
            raise ValueError("KVCacheGroups needs one window per group and at least one group")
        if any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"a sliding window must be >= 1, got {self.windows}")

    @classmethod
    def of(cls, model: ModelConfig) -> KVCacheGroups:
        """Layers bucketed by window, each bucket cut into groups of the smallest
        bucket's size (the last group of a bucket may be smaller: its blocks leave
        buffers unused, as vLLM pads such a group)."""
        buckets: dict[int | None, list[int]] = {}
        for layer in range(model.num_hidden_layers):
            buckets.setdefault(model.layer_window(layer), []).append(layer)
        size = min(len(b) for b in buckets.values())
        layers, windows = [], []
        for window, members in buckets.items():
            for i in range(0, len(members), size):
                layers.append(tuple(members[i : i + size]))
                windows.append(window)
        return cls(tuple(layers), tuple(windows))

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def group_size(self) -> int:
        """Layers one block holds: the cache's number of buffers."""
        return max(len(g) for g in self.layers)

    @property
    def hybrid(self) -> bool:
        """True when some group drops blocks behind a sliding window."""
        return any(w is not None for w in self.windows)

    @property
    def primary(self) -> int:
        """The group whose cached blocks stand for the prefix cache's contents (what a
        prefix registry is told): the first full-attention one, which holds every block of
        a cached prefix."""
        return next((g for g, w in enumerate(self.windows) if w is None), 0)

    def placement(self) -> list[tuple[int, int]]:
        """Per layer: (its group, its buffer)."""
        where: dict[int, tuple[int, int]] = {}
        for g, members in enumerate(self.layers):
            for j, layer in enumerate(members):
                where[layer] = (g, j)
        return [where[layer] for layer in sorted(where)]

    def first_block(self, group: int, first_query: int, block_size: int) -> int:
        """The first block group `group` needs for queries from position `first_query`
        on: 0 for full attention, else the block of the window's first key."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, first_query - window + 1) // block_size

    def spans(self, num_tokens: int, skip_blocks: int, block_size: int) -> list[tuple[int, int]]:
        """Per group, the blocks [lo, hi) of a context of `num_tokens` that an engine
        holding its first `skip_blocks` needs to compute the token after it: what a KV
        handoff moves, group after group."""
        hi = -(-num_tokens // block_size)
        return [
            (min(hi, max(skip_blocks, self.first_block(g, num_tokens, block_size))), hi)
            for g in range(self.num_groups)
        ]

    def blocks_needed(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """Most blocks one sequence of `num_tokens` holds at once when computed in steps
        of at most `chunk` tokens: a sliding group holds its window and a step's chunk."""
        blocks = -(-num_tokens // block_size)
        total = 0
        for window in self.windows:
            if window is None:
                total += blocks
            else:
                total += min(blocks, -(-(window - 1 + chunk) // block_size) + 1)
        return total
