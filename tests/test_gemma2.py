"""Gemma 2 against transformers' own Gemma2ForCausalLM on random-weight checkpoints:
attention and final logit soft-capping, alternating sliding and full layers on the
hybrid KV cache; prompt logits, greedy output, batched, chunked and cached runs, TP."""

from __future__ import annotations

import pytest
from arch_checks import (
    ArchitectureConformance,
    architecture_fixtures,
    assert_greedy_matches,
    prompts,
)

from workers.model import kernels
from workers.model.config import ModelConfig

BASE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "sliding_window": 20,
    "query_pre_attn_scalar": 48,
    "eos_token_id": 0,
    "bos_token_id": None,
    "pad_token_id": 0,
}
VARIANTS = {
    # Gemma 2's own caps (50 on scores, 30 on logits), GQA, head_dim 64.
    "caps-50-30": {},
    # Caps small enough to bend most scores and logits; head_dim 128, MQA.
    "caps-2-3-d128": {
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
        "head_dim": 128,
        "num_key_value_heads": 1,
    },
}


def _config(**fields):
    from transformers import Gemma2Config

    return Gemma2Config(**{**BASE, **fields})


model_dir, reference = architecture_fixtures("Gemma2ForCausalLM", _config, VARIANTS)


class TestGemma2(ArchitectureConformance):
    """Prompt logits, greedy output, batched / chunked / cached runs, TP 2."""

    def test_greedy_output_matches_on_torch_ops_alone(self, model_dir, reference, monkeypatch):
        # The path of a machine without a compiler, and of CUDA.
        monkeypatch.setattr(kernels, "library", lambda: None)
        assert_greedy_matches(model_dir, reference, prompts(3))


def test_the_config_reads_as_transformers_reads_it():
    reference = _config()
    ours = ModelConfig.from_dict({"model_type": "gemma2", **reference.to_dict()})
    assert ours.family == "gemma2"
    assert ours.layer_types == tuple(reference.layer_types)
    assert [ours.layer_window(i) for i in range(4)] == [20, None, 20, None]
    assert (ours.attn_logit_softcapping, ours.final_logit_softcapping) == (50.0, 30.0)
    assert ours.attention_scale == 48**-0.5
    assert ours.rope_theta == ours.local_rope_theta == 10_000.0
    # A config.json with only the shapes takes Gemma2Config's defaults.
    bare = ModelConfig.from_dict({"model_type": "gemma2", "num_hidden_layers": 2})
    assert (bare.head_dim, bare.sliding_window, bare.final_logit_softcapping) == (256, 4096, 30.0)


def test_scaled_rope_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="scaled rope on Gemma 2"):
        ModelConfig.from_dict(
            {"model_type": "gemma2", **BASE, "rope_scaling": {"rope_type": "linear", "factor": 2}}
        )
