"""The model against transformers' own LlamaForCausalLM on random-weight checkpoints."""

from __future__ import annotations

import pytest
import torch
from tiny_model import make_tiny_model

from workers.model.attention_metadata import AttentionMetadata, PrefillChunk
from workers.model.loader import load_model


def _prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    n = ids.numel()
    for attn in model.attention_layers():
        shape = (attn.num_kv_heads, n, attn.head_dim)
        attn.bind_cache(torch.zeros(shape), torch.zeros(shape))
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillChunk(0, n)])
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(n), [meta]))


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"tie_word_embeddings": True},
        {"num_kv_heads": 4},  # plain multi-head attention
        {"num_kv_heads": 1},  # multi-query attention
        {"attention_bias": True},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ],
    ids=["base", "tied", "mha", "mqa", "qkv-bias", "llama3-rope"],
)
def test_logits_match_transformers(tmp_path, variant):
    from transformers import LlamaForCausalLM

    model_dir = make_tiny_model(tmp_path, **variant)
    reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = load_model(model_dir)
    ids = torch.randint(0, 320, (200,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    assert (_prefill_logits(ours, ids) - expected).abs().max() < 1e-4


def test_missing_tensor_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_model(tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj"):
        load_model(model_dir)


def test_folder_without_safetensors_is_refused(tmp_path):
    model_dir = make_tiny_model(tmp_path)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        load_model(model_dir)


def test_a_missing_part_of_a_packed_layer_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_model(tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]  # q and v are still there
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match="qkv_proj"):
        load_model(model_dir)


def test_model_identity_tells_same_named_checkpoints_apart(tmp_path):
    from workers.model.loader import model_identity

    a = make_tiny_model(tmp_path / "a" / "same-name", seed=0)
    b = make_tiny_model(tmp_path / "b" / "same-name", seed=1)
    a_again = make_tiny_model(tmp_path / "c" / "same-name", seed=0)
    assert model_identity(a).startswith("same-name-")
    assert model_identity(a) != model_identity(b)
    assert model_identity(a) == model_identity(a_again)


@pytest.mark.parametrize("dim", [64, 60])  # 60: not whole vectors, so torch's rms_norm
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_adds_the_residual_and_normalizes_as_torch_does(dim, with_residual):
    from workers.model.norm import RMSNorm

    gen = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-5, torch.float32)
    norm.weight.copy_(torch.randn(dim, generator=gen))
    x, residual = torch.randn(2, 7, dim, generator=gen), torch.randn(2, 7, dim, generator=gen)
    summed = x + residual if with_residual else x
    expected = torch.nn.functional.rms_norm(summed, (dim,), norm.weight, 1e-5)
    if with_residual:
        out, stream = norm(x, residual)
        assert torch.equal(stream, summed)
    else:
        out = norm(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 32, 80])
# 24: whole AVX2 vectors only (AVX2's form on either CPU); 12: not whole vectors, torch's ops
@pytest.mark.parametrize("half", [1536, 24, 12])
def test_silu_mul_is_torchs_swiglu_activation(vector_width, rows, half):
    from workers.model.mlp import silu_mul

    gen = torch.Generator().manual_seed(rows * half)
    # Wide enough to reach both ends of the exponential's range.
    gate_up = torch.randn(rows, 2 * half, generator=gen) * 30
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = silu_mul(gate_up)
    assert out.shape == (rows, half)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-30)
