"""Qwen3-MoE as one readable model: Qwen3's attention (QK-norm) and Llama-family layers,
with a sparse mixture of experts (moe.py) as the MLP of every `decoder_sparse_step`-th
layer not listed in mlp_only_layers: a softmax router over `num_experts`, the top
`num_experts_per_tok` per token, renormalized where norm_topk_prob says, no shared
expert. The other layers keep a dense MLP of `intermediate_size`.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.config import ModelConfig
from workers.model.models.causal_lm import CausalLM
from workers.model.models.llama import LlamaModel
from workers.model.models.qwen3 import Qwen3DecoderLayer
from workers.model.moe import SparseMoE
from workers.model.parallel import TPGroup


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype) -> nn.Module:
        if layer in cfg.moe_layers:
            return SparseMoE(cfg, tp, dtype)
        return super().make_mlp(cfg, layer, tp, dtype)


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(CausalLM):
    decoder_class = Qwen3MoeModel
