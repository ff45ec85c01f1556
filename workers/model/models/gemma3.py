"""Gemma 3's text model (Gemma3ForCausalLM) as one readable model.

Where it departs from the Llama family: every norm is x / rms(x) * (1 + weight) in
float32; four norms a layer (around attention and around the MLP, the residual added
after each post-norm); per-head RMSNorm of queries and keys before rope; a GeGLU MLP
(gelu_pytorch_tanh); embeddings scaled by sqrt(hidden) in the model's dtype; scores
scaled by query_pre_attn_scalar ** -0.5; and layers of two kinds (`layer_types`):
sliding layers attend to the last `sliding_window` keys with rope base 10k, full layers
to the whole context with base 1M and the config's rope scaling.

Tensor parallelism lives inside the layers (see `parallel.py`), as in `llama.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.attention import PagedAttention
from workers.model.attention_metadata import AttentionMetadata, layer_metadata
from workers.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from workers.model.mlp import GatedMLP
from workers.model.models.causal_lm import CausalLM
from workers.model.norm import fused_rms_norm
from workers.model.parallel import (
    TensorSlice,
    TPGroup,
    VocabParallelEmbedding,
)
from workers.model.qkv_attention import QKVAttention
from workers.model.rope import RotaryEmbedding, apply_rope

RopeTables = tuple[torch.Tensor, torch.Tensor]


class Gemma3RMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 and cast back to x's dtype (so in
    bfloat16 the product is rounded once, as transformers' Gemma3RMSNorm does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        # The checkpoint's weight, kept as loaded; `scale` is the 1 + weight the norm
        # multiplies by, made once when the weight is loaded rather than every call.
        self.weight = nn.Parameter(torch.zeros(dim, dtype=torch.float32), requires_grad=False)
        self.register_buffer("scale", torch.ones(dim, dtype=torch.float32), persistent=False)

    def load_weight(self, param_name: str, src: TensorSlice, shard_id: str | None = None) -> None:
        self.weight.data.copy_(src[:].to(torch.float32))
        self.scale.copy_(1.0 + self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); given the residual stream, (norm(x + residual), x + residual), the
        add in x's dtype as the reference adds the stream."""
        fused = fused_rms_norm(x, self.scale, self.eps, residual)
        if fused is not None:
            out, summed = fused
            return out if residual is None else (out, summed)
        summed = x if residual is None else x + residual
        h = summed.float()
        out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale).to(x.dtype)
        return out if residual is None else (out, summed)


class Attention(QKVAttention):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__(cfg, tp, dtype)
        d = cfg.head_dim
        # One weight for every head, so each rank holds all of it.
        self.q_norm = Gemma3RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(d, cfg.rms_norm_eps)
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            d,
            scale=cfg.attention_scale,
            sliding_window=cfg.layer_window(layer),
        )

    def forward(
        self, x: torch.Tensor, rope: RopeTables, meta: list[AttentionMetadata]
    ) -> torch.Tensor:
        q, k, v = self.split_heads(self.qkv_proj(x))
        # Each head normalized over its own head_dim, then rotated.
        q = apply_rope(self.q_norm(q), *rope)
        k = apply_rope(self.k_norm(k), *rope)
        return self.o_proj(self.attn(q, k, v, meta))


class DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = Attention

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[layer]
        self.input_layernorm = Gemma3RMSNorm(hidden, eps)
        self.self_attn = self.attention_class(cfg, layer, tp, dtype)
        self.post_attention_layernorm = Gemma3RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, cfg.hidden_act, tp, dtype)
        self.post_feedforward_layernorm = Gemma3RMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ropes: dict[str, RopeTables],
        meta: list[AttentionMetadata],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's post-feedforward output, the residual stream before it): as in
        llama.py, each output joins the stream in the next norm's pass, and both are the
        selected rows' where `meta` selects rows."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        attn = self.post_attention_layernorm(self.self_attn(h, ropes[self.layer_type], meta))
        if meta[0].selected_rows is not None:
            residual = residual[meta[0].selected_rows]
        h, residual = self.pre_feedforward_layernorm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TPGroup, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        # sqrt(hidden) rounded to the model's dtype before it multiplies, as the
        # reference does (in bfloat16, sqrt(640) = 25.298 becomes 25.25).
        scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        bases = {
            FULL_ATTENTION: (cfg.rope_theta, cfg.rope_scaling),
            SLIDING_ATTENTION: (cfg.local_rope_theta, None),
        }
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(cfg.head_dim, max_positions, *bases[kind], dtype)
                for kind in sorted(set(cfg.layer_types))
            }
        )
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, tp, dtype) for i in range(cfg.num_hidden_layers)
        )
        self.norm = Gemma3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: list[AttentionMetadata],
        last_meta: list[AttentionMetadata] | None = None,
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(token_ids) * self.embed_scale, None
        ropes = {kind: rotary.tables(positions) for kind, rotary in self.rotary.items()}
        metas = layer_metadata(len(self.layers), meta, last_meta)
        for layer, layer_meta in zip(self.layers, metas, strict=True):
            x, residual = layer(x, residual, ropes, layer_meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class Gemma3ForCausalLM(CausalLM):
    decoder_class = Gemma3Model
