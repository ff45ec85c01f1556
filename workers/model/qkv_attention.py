"""The projections every family's attention layer shares: the checkpoint's q/k/v
projections packed into one column-parallel `qkv_proj` (CausalLM.packed_modules) and the
row-parallel `o_proj`, with this rank's share of the heads. A family's attention layer
subclasses it and adds what it does between them (rope, QK-norm, the paged attention)."""

from __future__ import annotations

import torch
from torch import nn

from workers.model.config import ModelConfig
from workers.model.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup


class QKVAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        d = cfg.head_dim
        _, self.num_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        # This rank's KV heads: its even share, or one head it shares with other ranks.
        kv_rows = tp.split_heads(cfg.num_key_value_heads, d)
        self.num_kv_heads = kv_rows[1] // d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.head_dim = d
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            {
                "q": cfg.num_attention_heads * d,
                "k": cfg.num_key_value_heads * d,
                "v": cfg.num_key_value_heads * d,
            },
            tp,
            bias=cfg.qkv_bias,
            dtype=dtype,
            ranks_rows={"k": kv_rows, "v": kv_rows},
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, tp, bias=cfg.o_proj_bias, dtype=dtype
        )

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's output [T, q + k + v] as views q [T, Hq, D], k and
        v [T, Hkv, D] of this rank's heads."""
        tokens, d = qkv.shape[0], self.head_dim
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, d)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(tokens, self.num_kv_heads, d)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, d)
        return q, k, v
