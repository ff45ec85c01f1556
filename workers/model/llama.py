"""The Llama family (Llama 2/3, Mistral, SmolLM, Qwen2) as one readable model.

Tensor parallelism lives inside the layers (see `parallel.py`): with a
single-rank `TPGroup` this is a plain dense model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import kernels
from workers.model.attention import AttentionMetadata, PagedAttention
from workers.model.config import ModelConfig
from workers.model.parallel import (
    ColumnParallelLinear,
    PackableLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    keep_faster_single_row_copy,
)
from workers.model.rope import RotaryEmbedding, apply_rope

RopeTables = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms_norm(x); given the residual stream, (rms_norm(x + residual), x + residual):
        the add and the norm are one pass of Baton's CPU kernel where it runs."""
        fits = x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] % 8 == 0
        lib = kernels.library() if fits else None
        if lib is None:
            if residual is None:
                return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
            summed = x + residual
            return F.rms_norm(summed, (x.shape[-1],), self.weight, self.eps), summed
        # Bound to names: a temporary's memory could go before the kernel reads it.
        x = x.contiguous()
        residual = None if residual is None else residual.contiguous()
        out = torch.empty_like(x)
        summed = None if residual is None else torch.empty_like(x)
        status = lib.baton_rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            self.weight.data_ptr(),
            x.numel() // x.shape[-1],
            x.shape[-1],
            self.eps,
            out.data_ptr(),
            None if summed is None else summed.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"rms_norm kernel refused rows of {x.shape[-1]} (status {status})")
        return out if summed is None else (out, summed)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        d = cfg.head_dim
        _, self.num_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        _, self.num_kv_heads = tp.split(cfg.num_key_value_heads, "num_key_value_heads")
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
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, tp, bias=cfg.o_proj_bias, dtype=dtype
        )
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d)

    def forward(self, x: torch.Tensor, rope: RopeTables, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        tokens = qkv.shape[0]
        # Q and K heads are rotated together in one pass.
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, -1, self.head_dim)
        q, k = apply_rope(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size,
            {"gate": cfg.intermediate_size, "up": cfg.intermediate_size},
            tp,
            dtype=dtype,
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up]: one pass of Baton's CPU kernel where it runs."""
    half = gate_up.shape[-1] // 2
    fits = gate_up.device.type == "cpu" and gate_up.dtype == torch.float32 and half % 8 == 0
    lib = kernels.library() if fits else None
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], half)
    rows = gate_up.numel() // gate_up.shape[-1]
    status = lib.baton_silu_mul(
        gate_up.data_ptr(), rows, half, out.data_ptr(), torch.get_num_threads()
    )
    if status != 0:
        raise RuntimeError(f"silu_mul kernel refused rows of {2 * half} (status {status})")
    return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, tp, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, tp, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): each layer's output
        joins the stream in the next norm, so the add rides along with the norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, meta), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, dtype) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(token_ids), None
        rope = self.rotary.tables(positions)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections packed into one parallel layer: name -> (layer, shard).
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup | None = None,
        max_positions: int | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        tp = tp or TPGroup.single()
        self.config = cfg
        self.model = LlamaModel(cfg, tp, max_positions or cfg.max_position_embeddings, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def pack_weights(self) -> None:
        """Re-lays out every projection for fast CPU matmuls (a no-op elsewhere), keeping
        for single rows whichever copy this CPU multiplies faster."""
        layers = [m for m in self.modules() if isinstance(m, PackableLinear)]
        for module in layers:
            module.pack()
        keep_faster_single_row_copy(layers)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] for the flattened step batch."""
        return self.model(token_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
