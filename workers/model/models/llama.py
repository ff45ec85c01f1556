"""The Llama family (Llama 2/3, Mistral, SmolLM, Qwen2) as one readable model.

Layers a config makes sliding (Mistral v0.1's window; Qwen2's with use_sliding_window)
attend to their window. Tensor parallelism lives inside the layers (see `parallel.py`):
with a single-rank `TPGroup` this is a plain dense model. Qwen3 (`qwen3.py`) is this
model with its own attention layer.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.attention import PagedAttention
from workers.model.attention_metadata import AttentionMetadata, layer_metadata
from workers.model.config import ModelConfig
from workers.model.mlp import GatedMLP
from workers.model.models.causal_lm import CausalLM
from workers.model.norm import RMSNorm
from workers.model.parallel import (
    TPGroup,
    VocabParallelEmbedding,
)
from workers.model.qkv_attention import QKVAttention
from workers.model.rope import RotaryEmbedding, apply_rope

RopeTables = tuple[torch.Tensor, torch.Tensor]


class Attention(QKVAttention):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__(cfg, tp, dtype)
        # The score scale and soft-cap are the config's (None for the Llama family's own
        # models; Gemma 2 sets both and takes this layer as it is).
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


class DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Attention

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self.attention_class(cfg, layer, tp, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = self.make_mlp(cfg, layer, tp, dtype)

    def make_mlp(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype) -> nn.Module:
        """The layer's MLP: dense here; a mixture of experts where the family has one."""
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu", tp, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        meta: list[AttentionMetadata],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): each layer's output
        joins the stream in the next norm, so the add rides along with the norm. Where
        `meta` selects rows (attention_metadata.py), both are those rows'."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, meta)
        if meta[0].selected_rows is not None:
            residual = residual[meta[0].selected_rows]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TPGroup, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(
            self.layer_class(cfg, layer, tp, dtype) for layer in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: list[AttentionMetadata],
        last_meta: list[AttentionMetadata] | None = None,
    ) -> torch.Tensor:
        """Final hidden states; the last layer's metadata is `last_meta` where given (the
        rows it selects: CausalLM.forward)."""
        x, residual = self.embed_tokens(token_ids), None
        rope = self.rotary.tables(positions)
        metas = layer_metadata(len(self.layers), meta, last_meta)
        for layer, layer_meta in zip(self.layers, metas, strict=True):
            x, residual = layer(x, residual, rope, layer_meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    decoder_class = LlamaModel
