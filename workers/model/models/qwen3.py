"""Qwen3 (dense) as one readable model: the Llama family's layers with per-head RMSNorm
of queries and keys before rope (a weight of head_dim shared by every head, as in
transformers' Qwen3Attention), no QKV bias unless attention_bias sets it on all four
projections, and an explicit head_dim (128 whatever the hidden size). Long contexts
take YaRN rope scaling (rope.py); sliding layers, where use_sliding_window sets them,
attend to their window.
"""

from __future__ import annotations

import torch

from workers.model.attention import PagedAttention
from workers.model.attention_metadata import AttentionMetadata
from workers.model.config import ModelConfig
from workers.model.models.causal_lm import CausalLM
from workers.model.models.llama import DecoderLayer, LlamaModel, RopeTables
from workers.model.norm import RMSNorm
from workers.model.parallel import TPGroup
from workers.model.qkv_attention import QKVAttention
from workers.model.rope import apply_rope


class Qwen3Attention(QKVAttention):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__(cfg, tp, dtype)
        d = cfg.head_dim
        # One weight for every head, so each rank holds all of it.
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, d, sliding_window=cfg.layer_window(layer)
        )

    def forward(
        self, x: torch.Tensor, rope: RopeTables, meta: list[AttentionMetadata]
    ) -> torch.Tensor:
        q, k, v = self.split_heads(self.qkv_proj(x))
        # Each head normalized over its own head_dim, then rotated.
        q = apply_rope(self.q_norm(q.contiguous()), *rope)
        k = apply_rope(self.k_norm(k.contiguous()), *rope)
        return self.o_proj(self.attn(q, k, v, meta))


class Qwen3DecoderLayer(DecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(CausalLM):
    decoder_class = Qwen3Model
