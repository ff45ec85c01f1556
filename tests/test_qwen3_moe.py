"""Qwen3-MoE against transformers' own Qwen3MoeForCausalLM on random-weight checkpoints:
top-k softmax routing with and without norm_topk_prob, dense layers among sparse ones;
prompt logits, greedy output, batched, chunked and cached runs, TP (each rank holding its
slice of every expert)."""

from __future__ import annotations

import torch
from arch_checks import ArchitectureConformance, architecture_fixtures

from workers.model.config import ModelConfig
from workers.model.loader import load_model
from workers.model.moe import SparseMoE
from workers.model.parallel import TPGroup

BASE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "eos_token_id": 0,
    "bos_token_id": None,
    "pad_token_id": 0,
}
VARIANTS = {
    # Every layer sparse, top-2 of 8 renormalized; GQA, head_dim 64.
    "top2-norm-d64": {"norm_topk_prob": True},
    # Layer 1 dense (mlp_only_layers), top-3 weights as the softmax gives them; head_dim
    # 128, MQA, a tied head.
    "top3-dense-d128": {
        "num_experts_per_tok": 3,
        "mlp_only_layers": [1],
        "head_dim": 128,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    },
}


def _config(**fields):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**BASE, **fields})


model_dir, reference = architecture_fixtures("Qwen3MoeForCausalLM", _config, VARIANTS)


class TestQwen3Moe(ArchitectureConformance):
    """Prompt logits, greedy output, batched / chunked / cached runs, TP 2."""


def test_sparse_and_dense_layers_are_where_the_config_puts_them(model_dir):
    model = load_model(model_dir)
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    assert sparse == [i in model.config.moe_layers for i in range(3)]
    reference = _config(decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=6)
    ours = ModelConfig.from_dict({"model_type": "qwen3_moe", **reference.to_dict()})
    assert ours.moe_layers == (1, 5)  # every 2nd layer, but layer 3 stays dense
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size) == (8, 2, 32)


def test_experts_group_tokens_and_weigh_them_as_the_loop_over_tokens_does():
    """The grouped matmuls give each token the router-weighted sum of its experts."""
    cfg = ModelConfig.from_dict({"model_type": "qwen3_moe", **BASE})
    moe = SparseMoE(cfg, TPGroup.single(), torch.float32)
    g = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randn(7, 64, generator=g)
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    weights, ids = probs.topk(2, dim=-1)
    expected = torch.zeros_like(x)
    for t in range(7):
        for w, e in zip(weights[t], ids[t], strict=True):
            gate, up = (x[t] @ moe.experts.gate_up[e].weight.T).chunk(2)
            expected[t] += w * (
                (torch.nn.functional.silu(gate) * up) @ moe.experts.down[e].weight.T
            )
    torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-5)
