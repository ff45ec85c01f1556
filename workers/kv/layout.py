"""What two engines must agree on before one reads the other's KV blocks."""

from __future__ import annotations

from dataclasses import dataclass

from workers.model.config import ModelConfig


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
