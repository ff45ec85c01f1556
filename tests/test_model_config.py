"""ModelConfig: what a Hugging Face config.json says, and what it may not ask for."""

from __future__ import annotations

import pytest

from workers.model.config import ModelConfig

BASE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 32768,
}


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        ({"model_type": "llama", "sliding_window": 4096}, [None, None]),  # Llama has none
        ({"model_type": "mistral", "sliding_window": 4096}, [4096, 4096]),  # Mistral 7B v0.1
        ({"model_type": "mistral", "sliding_window": None}, [None, None]),  # v0.2 and later
        (
            {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False},
            [None, None],
        ),
        ({"model_type": "qwen2", "sliding_window": 4096}, [None, None]),  # off by default
        (
            {
                "model_type": "qwen2",
                "sliding_window": 4096,
                "use_sliding_window": True,
                "max_window_layers": 1,
            },
            [None, 4096],
        ),
    ],
)
def test_a_sliding_window_applies_to_the_layers_transformers_applies_it_to(fields, windows):
    from transformers import AutoConfig

    config = ModelConfig.from_dict({**BASE, **fields})
    assert [config.layer_window(i) for i in range(2)] == windows
    # The context stays the model's: sliding layers keep their window in the KV cache.
    assert config.max_position_embeddings == 32768
    if fields["model_type"] == "llama":
        return  # its attention reads no sliding_window, whatever the config holds
    reference = AutoConfig.for_model(**{**BASE, **fields})
    # Mistral's attention takes the config's window on every layer; Qwen2 lists them.
    kinds = (
        getattr(reference, "layer_types", None)
        or ["sliding_attention" if reference.sliding_window else "full_attention"] * 2
    )
    assert [w is not None for w in windows] == [k == "sliding_attention" for k in kinds]


def test_an_mlp_activation_other_than_silu_is_refused():
    assert ModelConfig.from_dict({**BASE, "hidden_act": "silu"}).hidden_size == 64
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_dict({**BASE, "hidden_act": "gelu"})


def test_a_tp_degree_must_split_the_heads_and_the_mlp_width():
    # 1, 2 and 4 split 4 query and 4 KV heads; an MLP 90 wide leaves 1 and 2.
    config = ModelConfig.from_dict({**BASE, "num_key_value_heads": 4, "intermediate_size": 90})
    assert config.valid_tp_degrees() == [1, 2]
    config.check_tp_degree(2)
    with pytest.raises(ValueError, match=r"decode.tp=4 .* MLP width 90.*valid degrees: \[1, 2\]"):
        config.check_tp_degree(4, "decode.tp")


def test_a_tp_degree_past_the_kv_heads_replicates_them():
    # One KV head: every degree splitting the 4 query heads works, each rank holding it.
    one = ModelConfig.from_dict({**BASE, "num_key_value_heads": 1})
    assert one.valid_tp_degrees() == [1, 2, 4]
    assert [one.kv_heads_per_rank(d) for d in (1, 2, 4)] == [1, 1, 1]
    # 6 query and 4 KV heads: 2 splits both; 3 and 6 neither divide 4 nor are multiples.
    six = ModelConfig.from_dict(
        {**BASE, "num_attention_heads": 6, "num_key_value_heads": 4, "intermediate_size": 96}
    )
    assert six.valid_tp_degrees() == [1, 2]
    with pytest.raises(ValueError, match="neither divides nor is a multiple of its 4 KV heads"):
        six.check_tp_degree(3)
    two = ModelConfig.from_dict({**BASE, "num_key_value_heads": 2})
    assert two.valid_tp_degrees() == [1, 2, 4] and two.kv_heads_per_rank(4) == 1
