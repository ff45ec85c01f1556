"""Model architecture description read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def kv_shards(num_kv_heads: int, tp: int) -> int:
    """How many distinct KV-head shares `tp` ranks hold: `tp` where it divides the KV
    heads, the heads' count where `tp` is a multiple of it (each head replicated)."""
    if num_kv_heads % tp == 0:
        return tp
    if tp % num_kv_heads == 0:
        return num_kv_heads
    raise ValueError(
        f"the TP degree {tp} neither divides the {num_kv_heads} KV heads nor is a multiple of them"
    )


# model_type -> the family (a module of workers/model/models/) that runs it.
MODEL_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_FAMILIES)

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Every frequency slowed by `factor` (positions interpolated); Gemma 3's global
    layers (4B and up) use it."""

    factor: float


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (arXiv 2309.00071), Qwen's long-context setting: frequencies that turn fewer
    than `beta_slow` times over the original context are slowed by `factor`, those that
    turn more than `beta_fast` times are kept, a linear ramp between; cos and sin are
    scaled by `attention_factor` (0.1 ln(factor) + 1 unless the config sets it), which
    scales every attention score by its square."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


AnyRopeScaling = RopeScaling | LinearRopeScaling | YarnRopeScaling


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Of full-attention layers; sliding layers take `local_rope_theta` unscaled if set.
    rope_scaling: AnyRopeScaling | None = None
    hidden_act: str = "silu"
    # One per layer, transformers' names: FULL_ATTENTION or SLIDING_ATTENTION.
    layer_types: tuple[str, ...] = ()
    # Keys a query of a sliding layer sees, itself included (transformers' mask:
    # kv > q - window).
    sliding_window: int | None = None
    local_rope_theta: float | None = None
    # Scores scale by query_pre_attn_scalar ** -0.5 where set, else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral): the layers whose MLP is sparse, experts
    # in it, how many each token takes, each one's MLP width, and whether the top-k
    # router weights are renormalized to sum to 1.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Scores and final logits capped at cap * tanh(x / cap) where set (Gemma 2).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @property
    def family(self) -> str:
        """The module of workers/model/models/ that runs this model."""
        return MODEL_FAMILIES[self.model_type]

    @property
    def attention_scale(self) -> float | None:
        """The scores' scale; None for SDPA's default, head_dim ** -0.5."""
        if self.query_pre_attn_scalar is None:
            return None
        return self.query_pre_attn_scalar**-0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None where it attends to the whole context."""
        sliding = self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION
        return self.sliding_window if sliding else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "llama")
        if model_type not in MODEL_FAMILIES:
            hint = (
                " (a multimodal Gemma 3 config; Baton runs the text-only Gemma3ForCausalLM, "
                "model_type 'gemma3_text')"
                if model_type == "gemma3"
                else ""
            )
            raise ValueError(
                f"model_type {model_type!r} is not supported{hint}; supported model types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (README.md, 'Supported models')"
            )
        family = MODEL_FAMILIES[model_type]
        if family in _GEMMA_DEFAULTS:
            raw = {**_GEMMA_DEFAULTS[family], **raw}
            return cls(**_common_fields(raw, model_type), **_gemma_fields(raw, family))
        return cls(
            **_common_fields(raw, model_type),
            **_llama_fields(raw, model_type),
            **_moe_fields(raw, model_type),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(
                f"model: {model_dir} has no config.json; pass a Hugging Face model folder "
                "(config.json, *.safetensors, tokenizer.json)"
            )
        return cls.from_dict(json.loads(path.read_text()))

    def valid_tp_degrees(self) -> list[int]:
        """TP degrees that split the query heads and the MLP's intermediate width evenly
        (column-parallel layers shard each; an expert's too) and either divide the KV heads or are a
        multiple of them (each KV head then replicated; parallel.kv_shards)."""
        kv = self.num_key_value_heads
        return [
            d
            for d in range(1, self.num_attention_heads + 1)
            if self.num_attention_heads % d == 0
            and self.intermediate_size % d == 0
            and self.moe_intermediate_size % d == 0
            and (kv % d == 0 or d % kv == 0)
        ]

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads each of `tp` ranks holds in its cache."""
        return self.num_key_value_heads // kv_shards(self.num_key_value_heads, tp)

    def check_tp_degree(self, tp: int, field: str = "tensor_parallel_size") -> None:
        """ValueError, naming `field` and the valid degrees, unless `tp` splits the heads
        and the MLP."""
        if tp not in self.valid_tp_degrees():
            raise ValueError(
                f"{field}={tp} does not divide the model's {self.num_attention_heads} "
                f"attention heads and MLP width {self.intermediate_size}, or neither divides "
                f"nor is a multiple of its {self.num_key_value_heads} KV heads; valid "
                f"degrees: {self.valid_tp_degrees()}"
            )


def _common_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """What every family reads alike."""
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return {
        "model_type": model_type,
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(raw["intermediate_size"]),
        "num_hidden_layers": int(raw["num_hidden_layers"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(raw.get("num_key_value_heads") or num_heads),
        "head_dim": int(raw.get("head_dim") or hidden // num_heads),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": eos_ids,
    }


def _llama_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported (no Llama-family release uses it)")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported; Llama-family MLPs use 'silu'")
    # Transformers 5 writes rope settings (theta included) as rope_parameters.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    attention_bias = bool(raw.get("attention_bias", False))
    max_positions = int(raw.get("max_position_embeddings", 2048))
    layer_types, window = _llama_layer_types(raw, model_type)
    return {
        "rope_theta": float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        "max_position_embeddings": max_positions,
        # Qwen2 always biases Q/K/V but not O; Llama's and Qwen3's attention_bias covers
        # all four.
        "qkv_bias": attention_bias or model_type == "qwen2",
        "o_proj_bias": attention_bias and model_type != "qwen2",
        "rope_scaling": _parse_rope_scaling(rope, "rope_scaling", max_positions),
        "hidden_act": "silu",
        "layer_types": layer_types,
        "sliding_window": window,
    }


def _moe_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Qwen3-MoE's experts (on every `decoder_sparse_step`-th layer not in
    mlp_only_layers) and Mixtral's (every layer, `intermediate_size` wide, top-k always
    renormalized), as transformers reads them; nothing for a dense model."""
    layers = int(raw["num_hidden_layers"])
    if model_type == "mixtral":
        experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 8)
        return {
            "moe_layers": tuple(range(layers)),
            "num_experts": experts,
            "num_experts_per_tok": _top_k(raw, experts, 2),
            "moe_intermediate_size": int(raw["intermediate_size"]),
            "norm_topk_prob": True,
        }
    if model_type != "qwen3_moe":
        return {}
    # transformers 5 writes Qwen3-MoE's num_experts under Mixtral's name.
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 128)
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    sparse = tuple(
        i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0
    )
    return {
        "moe_layers": sparse,
        "num_experts": experts,
        "num_experts_per_tok": _top_k(raw, experts, 8) if sparse else 0,
        "moe_intermediate_size": int(raw.get("moe_intermediate_size", 768)) if sparse else 0,
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
    }


def _top_k(raw: dict[str, Any], experts: int, default: int) -> int:
    k = int(raw.get("num_experts_per_tok", default))
    if not 1 <= k <= experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {experts}] (the experts), got {k}")
    return k


def _llama_layer_types(raw: dict[str, Any], model_type: str) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) as transformers reads them: Mistral's window (v0.1's
    4096) and Mixtral's cover every layer; Qwen2's and Qwen3's, with use_sliding_window, the layers
    from max_window_layers on (or as `layer_types` lists); Llama has none. The sliding
    layers keep only their window in the KV cache, so the context stays the model's."""
    layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window")
    if model_type in ("mistral", "mixtral"):
        kind = SLIDING_ATTENTION if window else FULL_ATTENTION
        return (kind,) * layers, int(window) if window else None
    if model_type == "llama" or not raw.get("use_sliding_window"):
        window = None
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", layers)) if window else layers
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
    return _checked_layer_types(types, layers, window)


def _checked_layer_types(
    types: list[str], layers: int, window: Any
) -> tuple[tuple[str, ...], int | None]:
    unknown = set(types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if len(types) != layers or unknown:
        raise ValueError(
            f"layer_types must list {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r} for each of "
            f"the {layers} layers; got {types!r}"
        )
    if SLIDING_ATTENTION not in types:
        return tuple(types), None
    if window is None or int(window) < 1:
        raise ValueError(
            f"sliding_window={window!r}: the config has sliding layers, so it needs a "
            "window of 1 or more tokens"
        )
    return tuple(types), int(window)


# Gemma3TextConfig's defaults, for keys a config.json leaves out (Gemma 2B's shapes; a
# head_dim of 256 whatever the hidden size, tied embeddings).
_GEMMA3_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
}
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_THETA = {FULL_ATTENTION: 1_000_000.0, SLIDING_ATTENTION: 10_000.0}


# Gemma2Config's defaults (Gemma 2 2B's shapes; every other layer sliding).
_GEMMA2_DEFAULTS = {
    "vocab_size": 256_000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}
_GEMMA_DEFAULTS = {"gemma2": _GEMMA2_DEFAULTS, "gemma3": _GEMMA3_DEFAULTS}


def _gemma_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """Gemma 2's and Gemma 3's text models, read as transformers' Gemma2Config and
    Gemma3TextConfig read them."""
    name = {"gemma2": "Gemma 2", "gemma3": "Gemma 3"}[family]
    if raw.get("use_bidirectional_attention"):
        raise ValueError(
            f"use_bidirectional_attention=true is not supported; Baton runs causal "
            f"(generative) {name} models"
        )
    attn_cap = raw.get("attn_logit_softcapping")
    if family == "gemma3" and attn_cap is not None:
        raise ValueError(
            "attn_logit_softcapping is not supported (Gemma 3 releases leave it null); "
            "set it to null"
        )
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"hidden_activation {act!r} is not supported; {name} MLPs use 'gelu_pytorch_tanh'"
        )
    if family == "gemma2":
        layer_types, window = _gemma2_layer_types(raw)
        full_rope = local_rope = _gemma2_rope(raw)
    else:
        layer_types, window = _gemma3_layer_types(raw)
        full_rope, local_rope = _gemma3_rope(raw)
    softcap = raw.get("final_logit_softcapping")
    attention_bias = bool(raw.get("attention_bias", False))
    return {
        "rope_theta": float(full_rope["rope_theta"]),
        # The whole context: sliding layers attend to exactly their window.
        "max_position_embeddings": int(raw["max_position_embeddings"]),
        "qkv_bias": attention_bias,
        "o_proj_bias": attention_bias,
        "rope_scaling": _parse_rope_scaling(full_rope, "rope_parameters.full_attention"),
        "hidden_act": act,
        "layer_types": layer_types,
        "sliding_window": window,
        "local_rope_theta": float(local_rope["rope_theta"]),
        "query_pre_attn_scalar": float(raw["query_pre_attn_scalar"]),
        "attn_logit_softcapping": None if attn_cap is None else float(attn_cap),
        "final_logit_softcapping": None if softcap is None else float(softcap),
    }


def _gemma2_layer_types(raw: dict[str, Any]) -> tuple[tuple[str, ...], int | None]:
    """`layer_types`, or every other layer sliding from the first (Gemma2Config's)."""
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [
        SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(layers)
    ]
    return _checked_layer_types(types, layers, raw["sliding_window"])


def _gemma2_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """The one rope every Gemma 2 layer takes; scaled rope (no release uses it) refused."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if _parse_rope_scaling(rope, "rope_parameters") is not None:
        raise ValueError(
            "rope_parameters: scaled rope on Gemma 2 is not supported; use rope_type 'default'"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            "rope_parameters.partial_rotary_factor is not supported; Baton rotates the "
            "whole head (1.0)"
        )
    rope.setdefault("rope_theta", raw.get("rope_theta", 10_000.0))
    return rope


def _gemma3_layer_types(raw: dict[str, Any]) -> tuple[tuple[str, ...], int | None]:
    """(`layer_types`, or, in older configs, every `sliding_window_pattern`-th layer full
    and the others sliding; the window)."""
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        pattern = int(
            raw.get("sliding_window_pattern")
            or raw.get("_sliding_window_pattern")
            or _GEMMA3_SLIDING_PATTERN
        )
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]
    return _checked_layer_types(types, layers, raw["sliding_window"])


def _gemma3_rope(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full-attention, sliding-attention) rope parameters: transformers 5's
    rope_parameters per layer type, with an old config's rope_scaling applied to full
    layers and its rope_theta / rope_local_base_freq as the bases."""
    given = raw.get("rope_parameters") or {}
    full = dict(given.get(FULL_ATTENTION) or {"rope_type": "default"})
    local = dict(given.get(SLIDING_ATTENTION) or {"rope_type": "default"})
    if raw.get("rope_scaling"):
        full.update(raw["rope_scaling"])
    full.setdefault("rope_theta", raw.get("rope_theta", _GEMMA3_THETA[FULL_ATTENTION]))
    local.setdefault(
        "rope_theta", raw.get("rope_local_base_freq", _GEMMA3_THETA[SLIDING_ATTENTION])
    )
    if _parse_rope_scaling(local, "rope_parameters.sliding_attention") is not None:
        raise ValueError(
            "rope_parameters.sliding_attention: scaled rope on sliding layers is not "
            "supported; use rope_type 'default'"
        )
    for kind, params in ((FULL_ATTENTION, full), (SLIDING_ATTENTION, local)):
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"rope_parameters.{kind}.partial_rotary_factor is not supported; Baton "
                "rotates the whole head (1.0)"
            )
    return full, local


def _parse_rope_scaling(
    raw: dict[str, Any] | None, field: str, max_positions: int | None = None
) -> AnyRopeScaling | None:
    """The rope scaling a config's rope_parameters (or rope_scaling) asks for; YaRN
    without a factor takes the context over the original one, as transformers does."""
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return LinearRopeScaling(factor=float(raw["factor"]))
    if kind == "yarn":
        return _yarn(raw, field, max_positions)
    if kind != "llama3":
        raise ValueError(
            f"{field} type {kind!r} is not supported (supported: 'default', 'linear', "
            "'llama3', 'yarn')"
        )
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


def _yarn(raw: dict[str, Any], field: str, max_positions: int | None) -> YarnRopeScaling:
    original = raw.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(f"{field}: YaRN needs original_max_position_embeddings")
    original = int(original)
    factor = raw.get("factor")
    if factor is None:
        if max_positions is None:
            raise ValueError(f"{field}: YaRN needs a factor")
        factor = max_positions / original
    factor = float(factor)
    if not factor >= 1.0:
        raise ValueError(f"{field}: a YaRN factor must be >= 1, got {factor}")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = raw.get("attention_factor")
    if attention is None:
        m, m_all = raw.get("mscale"), raw.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return YarnRopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(raw.get("beta_fast") or 32.0),
        beta_slow=float(raw.get("beta_slow") or 1.0),
        attention_factor=float(attention),
        truncate=bool(raw.get("truncate", True)),
    )
