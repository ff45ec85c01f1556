"""Mixtral as one readable model: Mistral's layers (a sliding window on every layer where
the config sets one) with a sparse mixture of experts (moe.py) as every layer's MLP:
`num_local_experts` experts of `intermediate_size`, the top 2 per token, their router
weights renormalized to sum to 1. Its checkpoint calls the MLP `block_sparse_moe` and an
expert's projections w1 (gate), w3 (up) and w2 (down).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.config import ModelConfig
from workers.model.models.causal_lm import CausalLM
from workers.model.models.llama import DecoderLayer, LlamaModel
from workers.model.moe import SparseMoE
from workers.model.parallel import TPGroup


class MixtralDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype) -> nn.Module:
        return SparseMoE(cfg, tp, dtype)


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer


class MixtralForCausalLM(CausalLM):
    decoder_class = MixtralModel
    renamed_modules = {"block_sparse_moe": "mlp"}
