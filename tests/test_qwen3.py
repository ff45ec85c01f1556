"""Qwen3 (dense) against transformers' own Qwen3ForCausalLM on random-weight
checkpoints: QK-norm, head_dim 64 and 128, tied and untied heads, YaRN rope scaling and
sliding layers; prompt logits, greedy output, batched, chunked and cached runs, TP."""

from __future__ import annotations

import math

import pytest
import torch
from arch_checks import ArchitectureConformance, architecture_fixtures

from workers.model.config import ModelConfig, YarnRopeScaling
from workers.model.rope import rope_inv_freq

BASE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "eos_token_id": 0,
    "bos_token_id": None,
    "pad_token_id": 0,
}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}
VARIANTS = {
    # GQA, head_dim 64 (not hidden / heads), untied.
    "gqa-d64": {},
    # head_dim 128, MQA, a tied head, QKV and O biases.
    "mqa-d128-tied-bias": {
        "head_dim": 128,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
        "attention_bias": True,
    },
    # YaRN over an original context of 32 tokens: prompts run well past it.
    "yarn": {"rope_parameters": YARN},
    # use_sliding_window: layers from max_window_layers on attend to a window of 20.
    "sliding": {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1},
}


def _config(**fields):
    from transformers import Qwen3Config

    return Qwen3Config(**{**BASE, **fields})


model_dir, reference = architecture_fixtures("Qwen3ForCausalLM", _config, VARIANTS)


class TestQwen3(ArchitectureConformance):
    """Prompt logits, greedy output, batched / chunked / cached runs, TP 2."""


def test_the_config_reads_as_transformers_reads_it():
    reference = _config(**VARIANTS["sliding"], rope_parameters=YARN)
    ours = ModelConfig.from_dict({"model_type": "qwen3", **reference.to_dict()})
    assert ours.family == "qwen3" and not ours.qkv_bias and not ours.o_proj_bias
    assert ours.layer_types == tuple(reference.layer_types)
    assert [ours.layer_window(i) for i in range(3)] == [None, 20, 20]
    # The whole context: sliding layers keep their window in the KV cache.
    assert ours.max_position_embeddings == 2048
    scaling = ours.rope_scaling
    assert isinstance(scaling, YarnRopeScaling)
    assert (scaling.factor, scaling.original_max_position_embeddings) == (4.0, 32)
    assert scaling.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)


def test_yarn_frequencies_and_attention_factor_are_transformers_own():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for fields in (
        YARN,
        {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {**YARN, "attention_factor": 0.9},
        {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5},
    ):
        config = _config(rope_parameters=fields)
        expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        ours = ModelConfig.from_dict({"model_type": "qwen3", **config.to_dict()})
        torch.testing.assert_close(rope_inv_freq(64, 10000.0, ours.rope_scaling), expected)
        assert ours.rope_scaling.attention_factor == pytest.approx(factor)
