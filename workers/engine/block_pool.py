"""A fixed pool of KV-cache blocks with reference counts."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids; a block returns to the free queue when its last holder lets go.

    Freed blocks join the back of the queue and allocation takes from the front,
    so the queue is least-recently-freed first.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        # Checked as a whole first, so a bad call changes nothing.
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b] = counts.get(b, 0) + 1
        for b, n in counts.items():
            if not 0 <= b < self.num_blocks or self._refs[b] < n:
                raise RuntimeError(f"block {b} freed more often than it is held")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]
