"""What a GGUF file's tensors and metadata mean in Hugging Face terms, per architecture.

llama.cpp's converter renames every tensor, moves the config into metadata and, per
architecture, changes some weights: Llama's Q/K rows are permuted for interleaved rope,
Gemma's norm weights are stored as 1 + w. A `GGUFArch` holds those facts for one
`general.architecture`, so the converter (gguf_import.py) can undo them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.model.gguf_metadata import GGUFMetadata

__all__ = ["GGUF_ARCHS", "GGUFArch", "gguf_arch", "unpermute_qk"]

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTENTION_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
}

Config = dict[str, Any]


@dataclass(frozen=True)
class GGUFArch:
    """One GGUF architecture: its layer tensors' HF names (`blk.N.<suffix>` ->
    `model.layers.N.<name>`), the HF config its metadata gives, and the HF shapes a
    layer's tensors must have."""

    name: str
    layer_names: Mapping[str, str]
    build_config: Callable[[GGUFMetadata, set[str]], Config]
    layer_shapes: Callable[[Config], dict[str, tuple[int, ...]]]
    # llama.cpp permutes these rows for interleaved rope (Llama only).
    permutes_qk: bool = False
    # llama.cpp stores these norms' weights as 1 + w (Gemma: HF's norm multiplies by 1 + w).
    norm_offset: float = 0.0

    def hf_name(self, gguf_name: str) -> str:
        if gguf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_name]
        parts = gguf_name.split(".", 2)
        if (
            len(parts) == 3
            and parts[0] == "blk"
            and parts[1].isdigit()
            and parts[2] in self.layer_names
        ):
            return f"model.layers.{int(parts[1])}.{self.layer_names[parts[2]]}"
        # An unmapped tensor (biases, extra norms) means another architecture; dropping it
        # would produce a model that loads fine and generates garbage.
        raise ValueError(f"GGUF tensor {gguf_name!r} has no {self.name} counterpart")

    def permuted_heads(self, hf_name: str, config: Config) -> int | None:
        """The head count whose rows llama.cpp permuted in this weight, or None."""
        if not self.permutes_qk:
            return None
        return {
            "q_proj": config["num_attention_heads"],
            "k_proj": config["num_key_value_heads"],
        }.get(hf_name.split(".")[-2])

    def to_hf(self, hf_name: str, array: np.ndarray, config: Config) -> np.ndarray:
        """A dequantized stored tensor as the HF checkpoint holds it."""
        heads = self.permuted_heads(hf_name, config)
        if heads is not None:
            return unpermute_qk(array, heads)
        if self.norm_offset and hf_name.endswith("norm.weight"):
            return array - np.float32(self.norm_offset)
        return array


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter turns HF's rotate-half RoPE layout (first half of each head's rows
    paired with the second half) into interleaved pairs, via
    `w.reshape(n_head, 2, d // 2, in).swapaxes(1, 2)`; swapping the other two axes reverses it.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    head = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return head.swapaxes(1, 2).reshape(weight.shape)


def _common_config(meta: GGUFMetadata, tensor_names: set[str]) -> Config:
    hidden = int(meta.arch_get("embedding_length"))
    n_head = int(meta.arch_get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    config: Config = {
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_get("feed_forward_length")),
        "num_hidden_layers": int(meta.arch_get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.arch_get("attention.head_count_kv", n_head)),
        "head_dim": int(meta.arch_get("attention.key_length", hidden // n_head)),
        "rms_norm_eps": float(meta.arch_get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta.arch_get("context_length")),
        "vocab_size": int(meta.arch_get("vocab_size", len(tokens))),
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    for name in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id", None)
        if token_id is not None:
            config[f"{name.replace('padding', 'pad')}_token_id"] = int(token_id)
    return config


def _rope_scaling(meta: GGUFMetadata, supported: tuple[str, ...]) -> dict[str, Any] | None:
    kind = meta.arch_get("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    if kind not in supported:
        raise ValueError(
            f"{meta.path}: rope scaling type {kind!r} is not supported for {meta.arch} "
            f"(supported: {', '.join(supported) or 'none'})"
        )
    return {"rope_type": kind, "factor": float(meta.arch_get("rope.scaling.factor"))}


def _attention_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    hidden, head_dim, ffn = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    return {
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
        "input_layernorm.weight": (hidden,),
    }


def _llama_config(meta: GGUFMetadata, tensor_names: set[str]) -> Config:
    if meta.arch_get("expert_count", 0):
        raise ValueError(
            "mixture-of-experts GGUF files (Mixtral) are not supported; run the model's "
            "Hugging Face safetensors folder instead (README.md, 'Supported models')"
        )
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style frequency scaling lives in this tensor, and its parameters cannot be
        # recovered into HF's rope_scaling; converting without it would silently change outputs.
        raise ValueError("GGUF has a rope_freqs tensor (Llama 3.1 RoPE scaling); not supported")
    # Linear and YaRN scaling are metadata; the Llama model runs only Llama 3 scaling (which
    # GGUF stores as the refused tensor), so converting them would make a folder every load
    # then refuses.
    _rope_scaling(meta, supported=())
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_common_config(meta, tensor_names),
        "hidden_act": "silu",
        "rope_theta": float(meta.arch_get("rope.freq_base", 10000.0)),
        "mlp_bias": False,
    }


def _llama_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    hidden = config["hidden_size"]
    return {**_attention_shapes(config), "post_attention_layernorm.weight": (hidden,)}


# Facts of Gemma 3 that llama.cpp keeps in code, not in the file: every sixth layer is
# full attention, sliding layers rotate with base 10k.
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0
# llama.cpp scales Gemma 3 27B's scores by (hidden / heads) ** -0.5 and every other size's
# by head_dim ** -0.5; the 27B is the one with 62 layers.
_GEMMA3_27B_LAYERS = 62


def _gemma3_config(meta: GGUFMetadata, tensor_names: set[str]) -> Config:
    config = _common_config(meta, tensor_names)
    layers = config["num_hidden_layers"]
    pattern = meta.arch_get("attention.sliding_window_pattern", None)
    if isinstance(pattern, list):  # one flag per layer: true where the layer slides
        if len(pattern) != layers:
            raise ValueError(
                f"{meta.path}: attention.sliding_window_pattern lists {len(pattern)} layers, "
                f"the model has {layers}"
            )
        sliding = [bool(p) for p in pattern]
    else:
        every = int(pattern or _GEMMA3_SLIDING_PATTERN)
        sliding = [(i + 1) % every != 0 for i in range(layers)]
    scalar = (
        config["hidden_size"] / config["num_attention_heads"]
        if layers == _GEMMA3_27B_LAYERS
        else config["head_dim"]
    )
    scaling = _rope_scaling(meta, supported=("linear",))
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **config,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(meta.arch_get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": scalar,
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": float(meta.arch_get("rope.freq_base", 1_000_000.0)),
                **(scaling or {}),
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _gemma3_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    return {
        **_attention_shapes(config),
        "post_attention_layernorm.weight": (hidden,),
        "pre_feedforward_layernorm.weight": (hidden,),
        "post_feedforward_layernorm.weight": (hidden,),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
    }


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch(
        name="llama",
        layer_names={**_ATTENTION_NAMES, "ffn_norm.weight": "post_attention_layernorm.weight"},
        build_config=_llama_config,
        layer_shapes=_llama_shapes,
        permutes_qk=True,
    ),
    "gemma3": GGUFArch(
        name="gemma3",
        layer_names={
            **_ATTENTION_NAMES,
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
            "attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight",
        },
        build_config=_gemma3_config,
        layer_shapes=_gemma3_shapes,
        norm_offset=1.0,
    ),
}


def gguf_arch(meta: GGUFMetadata) -> GGUFArch:
    """The file's architecture, or a ValueError naming the supported ones."""
    arch = GGUF_ARCHS.get(meta.arch)
    if arch is None:
        raise ValueError(
            f"{meta.path}: architecture {meta.arch!r} is not supported; GGUF files of "
            f"{', '.join(repr(a) for a in GGUF_ARCHS)} can be converted"
        )
    return arch
