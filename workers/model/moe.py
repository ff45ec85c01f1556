"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router scores every expert per
token, the top k run (fused_experts.py) and their outputs are summed, weighted by the
router's softmax probabilities (renormalized over the k where the config says:
Qwen3-MoE's norm_topk_prob, always for Mixtral). The router is small and replicated on
every rank; the experts are split like the dense MLP, so one all-reduce sums the ranks'
partial outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.config import ModelConfig
from workers.model.fused_experts import FusedExperts
from workers.model.parallel import TPGroup


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        # The checkpoint's router weight [experts, hidden], whole on every rank.
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedExperts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.hidden_act,
            tp,
            dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.tp.all_reduce(self.experts(x, expert_ids, weights.to(x.dtype)))
