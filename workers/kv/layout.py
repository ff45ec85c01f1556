"""What two engines must agree on before one reads the other's KV blocks."""

from __future__ import annotations

from dataclasses import dataclass

from workers.kv.kv_groups import KVCacheGroups
from workers.model.config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    """What two engines must agree on before one can read the other's blocks."""

    num_layers: int
    num_kv_heads: int  # all ranks together
    head_dim: int
    block_size: int
    groups: KVCacheGroups

    @classmethod
    def of(cls, model: ModelConfig, block_size: int) -> KVLayout:
        return cls(
            model.num_hidden_layers,
            model.num_key_value_heads,
            model.head_dim,
            block_size,
            KVCacheGroups.of(model),
        )

    def spans(self, num_tokens: int, skip_blocks: int) -> list[tuple[int, int]]:
        """Per group, the request blocks [lo, hi) a handoff of `num_tokens` moves to an
        importer holding the first `skip_blocks` (KVCacheGroups.spans)."""
        return self.groups.spans(num_tokens, skip_blocks, self.block_size)

    def num_export_blocks(self, num_tokens: int, skip_blocks: int) -> int:
        """Blocks (of every group) such an export carries."""
        return sum(hi - lo for lo, hi in self.spans(num_tokens, skip_blocks))

    def import_rows(self, num_tokens: int, export_skip: int, held: int) -> list[int]:
        """Which blocks of an export that skipped `export_skip` blocks an importer holding
        the first `held` of them (at least as many) still needs: their indices in the
        export, in the order of `spans(num_tokens, held)`."""
        rows: list[int] = []
        offset = 0
        exported, needed = self.spans(num_tokens, export_skip), self.spans(num_tokens, held)
        for (first, hi), (lo, _) in zip(exported, needed, strict=True):
            rows.extend(range(offset + lo - first, offset + hi - first))
            offset += hi - first
        return rows
