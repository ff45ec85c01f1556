"""Mixtral against transformers' own MixtralForCausalLM on random-weight checkpoints (its
block_sparse_moe names, top-2 routing renormalized, a sliding window): prompt logits,
greedy output, batched, chunked and cached runs, TP."""

from __future__ import annotations

from arch_checks import ArchitectureConformance, architecture_fixtures

BASE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "eos_token_id": 0,
    "bos_token_id": None,
    "pad_token_id": 0,
}
VARIANTS = {
    # GQA, head_dim 64, no window (Mixtral 8x7B's release).
    "top2-d64": {},
    # head_dim 128 and a window of 20 on every layer, as Mistral v0.1's.
    "top2-d128-window": {"head_dim": 128, "sliding_window": 20},
}


def _config(**fields):
    from transformers import MixtralConfig

    return MixtralConfig(**{**BASE, **fields})


model_dir, reference = architecture_fixtures("MixtralForCausalLM", _config, VARIANTS)


class TestMixtral(ArchitectureConformance):
    """Prompt logits, greedy output, batched / chunked / cached runs, TP 2."""
