"""What every model family's causal LM shares: the LM head, the checkpoint names packed
into one parallel layer, weight packing, and the face the runner and loader use
(`forward`, `compute_logits`, `attention_layers`)."""

from __future__ import annotations

import torch
from torch import nn

from workers.model import kernels
from workers.model.attention import PagedAttention
from workers.model.attention_metadata import AttentionMetadata
from workers.model.config import ModelConfig
from workers.model.fused_decode import FusedDecode
from workers.model.parallel import (
    PackableLinear,
    ParallelLMHead,
    TPGroup,
    keep_faster_single_row_copy,
)


class CausalLM(nn.Module):
    # Checkpoint projections packed into one parallel layer: name -> (layer, shard).
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    # Checkpoint module names this family's modules go by instead (Mixtral's
    # block_sparse_moe is every other family's mlp).
    renamed_modules: dict[str, str] = {}

    # The family's decoder, built as decoder_class(cfg, tp, max_positions, dtype):
    # `embed_tokens`, `layers` (each with `self_attn.attn`) and its final norm, called
    # with (token_ids, positions, meta).
    decoder_class: type[nn.Module]

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
        self.model = self.decoder_class(
            cfg, tp, max_positions or cfg.max_position_embeddings, dtype
        )
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Pure-decode steps in one C call, where the family and weights allow it (set
        # when the caches are bound; None runs every step on the modules).
        self.fused_decode: FusedDecode | None = None

    def pack_weights(self) -> None:
        """Re-lays out every projection for fast CPU matmuls (a no-op elsewhere), keeping
        for single rows whichever copy this CPU multiplies faster."""
        layers = [m for m in self.modules() if isinstance(m, PackableLinear)]
        for module in layers:
            module.pack()
        keep_faster_single_row_copy(layers)

    def round_activations(self, bits: int) -> bool:
        """Sets the bits every projection in GGUF blocks rounds a one-row input to (16 or
        8; 32: exact; block_matmul.py), before the caches are bound (the fused decode step
        takes it from them). Whether any projection has blocks: a model without runs as
        before."""
        layers = [
            m for m in self.modules() if isinstance(m, PackableLinear) and m.blocks is not None
        ]
        for module in layers:
            module.activation_bits = bits
        return bool(layers)

    def small_step_rows(self) -> int:
        """Steps of up to this many rows run every projection, the LM head and the
        attention in Baton's kernels, on their work team (kernels.py): their torch ops
        are small and best left on one thread. 0 when a projection has no GGUF blocks
        (its matmuls are torch's)."""
        layers = [m for m in self.modules() if isinstance(m, PackableLinear)]
        if not layers or any(m.blocks is None for m in layers):
            return 0
        return kernels.team_max_rows()

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """Binds each attention layer's (k cache, v cache, KV-cache group), then builds
        the fused decode step over them where it runs."""
        for layer, (k, v, group) in zip(self.attention_layers(), caches, strict=True):
            layer.bind_cache(k, v, group)
        self.fused_decode = FusedDecode.build(self.model)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: list[AttentionMetadata],
        last_meta: list[AttentionMetadata] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] for the flattened step batch; with `last_meta`
        (the step's metadata selecting R rows: AttentionMetadata.select_rows), [R, hidden]
        for those rows, the others computed no further than the last layer's K/V."""
        fused = self.fused_decode
        if last_meta is None and fused is not None and fused.takes(meta, token_ids.shape[0]):
            return fused(token_ids, positions, meta)
        return self.model(token_ids, positions, meta, last_meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        # Soft-capped as transformers does: cap * tanh(logits / cap).
        return torch.tanh(logits / cap) * cap
