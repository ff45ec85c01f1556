"""A tiny Gemma 3 GGUF, written the way llama.cpp's converter writes one.

From a transformers Gemma3ForCausalLM (tiny_gemma3.py): tensors renamed to GGUF's
names, every norm weight stored as 1 + w, the embedding as Q8_0 and the MLP's gate/up
as Q5_0 (the types of Gemma 3 270M's file), the rest float32; a SentencePiece
vocabulary (specials, byte fallbacks, "▁"-pieces, runs of spaces as written) with no
merges, as Gemma files have.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# HF name within model.layers.N -> GGUF suffix of blk.N (the reverse of gguf_arch.py's map).
_LAYER = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
PIECES = ["▁", "a", "b", "c", "▁a", "▁b", "ab", "bc", "▁ab", "abc", "▁abc", "  ", "   "]


def vocabulary(vocab_size: int) -> list[str]:
    """Specials, the 256 byte fallbacks, pieces, then filler pieces up to `vocab_size`."""
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    tokens += [f"▁w{i}" for i in range(vocab_size - len(tokens))]
    assert len(tokens) == vocab_size
    return tokens


def write_gemma3_gguf(model, path: Path) -> dict[str, np.ndarray]:
    """Write `model` as a GGUF; returns the HF-layout weights a faithful converter must
    produce (quantized tensors as they dequantize)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    cfg = model.config
    tokens = vocabulary(cfg.vocab_size)
    types = [3] * len(SPECIALS) + [6] * 256 + [1] * (len(tokens) - len(SPECIALS) - 256)
    types[tokens.index("  ")] = types[tokens.index("   ")] = 4  # user-defined, as Gemma's are
    writer = GGUFWriter(str(path), "gemma3")
    arch = "gemma3"
    writer.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", 1_000_000.0)
    writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_string("tokenizer.ggml.pre", "default")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.scores", [-1000.0] * 4 + [0.0] * (len(tokens) - 4))
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.unknown_token_id", 3)
    writer.add_uint32("tokenizer.ggml.padding_token_id", 0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_space_prefix", False)

    expected: dict[str, np.ndarray] = {}
    state = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    for name, value in state.items():
        if name == "lm_head.weight":  # tied
            continue
        if name == "model.embed_tokens.weight":
            gguf_name, qtype = "token_embd.weight", GGMLQuantizationType.Q8_0
        elif name == "model.norm.weight":
            gguf_name, qtype = "output_norm.weight", None
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{_LAYER[rest]}"
            gate_up = rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight")
            qtype = GGMLQuantizationType.Q5_0 if gate_up else None
        stored = value + 1.0 if name.endswith("norm.weight") else value
        if qtype is None:
            writer.add_tensor(gguf_name, stored)
            expected[name] = value
        else:
            writer.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)
            expected[name] = dequantize(quantize(stored, qtype), qtype).reshape(stored.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
