"""Gemma 2 against transformers' own Gemma2ForCausalLM on random-weight checkpoints:
attention and final logit soft-capping, alternating sliding and full layers on the
hybrid KV cache; prompt logits, greedy output, batched, chunked and cached runs, TP."""

from __future__ import annotations

import pytest
from arch_checks import (
    assert_batched_chunked_and_cached_match_alone,
    assert_greedy_matches,
    assert_prompt_logits_match,
    assert_tp_ranks_match_one,
    make_random_model,
    prompts,
    reference_model,
)

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


@pytest.fixture(scope="module", params=list(VARIANTS))
def gemma2_dir(request, tmp_path_factory):
    from transformers import Gemma2ForCausalLM

    out = tmp_path_factory.mktemp(request.param)
    return make_random_model(Gemma2ForCausalLM, _config(**VARIANTS[request.param]), out)


@pytest.fixture(scope="module")
def reference(gemma2_dir):
    from transformers import Gemma2ForCausalLM

    return reference_model(Gemma2ForCausalLM, gemma2_dir)


def test_prompt_logits_match_transformers(gemma2_dir, reference):
    assert_prompt_logits_match(gemma2_dir, reference, length=90)


@pytest.mark.parametrize("kernels_on", [True, False], ids=["kernels", "torch-ops"])
def test_greedy_output_matches_transformers(gemma2_dir, reference, kernels_on, monkeypatch):
    from workers.model import kernels

    if not kernels_on:  # the path of a machine without a compiler, and of CUDA
        monkeypatch.setattr(kernels, "library", lambda: None)
    assert_greedy_matches(gemma2_dir, reference, prompts(3))


def test_batched_chunked_and_cached_runs_match_one_alone(gemma2_dir):
    assert_batched_chunked_and_cached_match_alone(gemma2_dir, prompts(4))


def test_tensor_parallel_ranks_compute_the_single_rank_logits(gemma2_dir, tmp_path):
    assert_tp_ranks_match_one(tmp_path, gemma2_dir)


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
