"""Gemma 2 as one readable model: Gemma 3's layers (four (1 + w) norms a layer, a GeGLU
MLP, embeddings scaled by sqrt(hidden), scores scaled by query_pre_attn_scalar ** -0.5)
without QK-norm, with attention scores soft-capped at cap * tanh(score / cap)
(attn_logit_softcapping, 50) and the final logits too (30); layers alternate sliding
(even ones, window 4096) and full, all with one rope base.
"""

from __future__ import annotations

import torch

from workers.model.attention import AttentionMetadata, PagedAttention
from workers.model.config import ModelConfig
from workers.model.models.causal_lm import CausalLM
from workers.model.models.gemma3 import DecoderLayer, Gemma3Model, RopeTables
from workers.model.parallel import TPGroup
from workers.model.qkv_attention import QKVAttention
from workers.model.rope import apply_rope


class Gemma2Attention(QKVAttention):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__(cfg, tp, dtype)
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            cfg.head_dim,
            scale=cfg.attention_scale,
            sliding_window=cfg.layer_window(layer),
            logit_softcap=cfg.attn_logit_softcapping,
        )

    def forward(
        self, x: torch.Tensor, rope: RopeTables, meta: list[AttentionMetadata]
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        tokens = qkv.shape[0]
        # Q and K heads are rotated together in one pass.
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, -1, self.head_dim)
        q, k = apply_rope(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta))


class Gemma2DecoderLayer(DecoderLayer):
    attention_class = Gemma2Attention


class Gemma2Model(Gemma3Model):
    layer_class = Gemma2DecoderLayer


class Gemma2ForCausalLM(CausalLM):
    decoder_class = Gemma2Model
