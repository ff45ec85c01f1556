"""Model architecture description read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    rope_scaling: RopeScaling | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "llama")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; Baton runs Llama-family "
                f"models ({', '.join(_SUPPORTED_MODEL_TYPES)})"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        if raw.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported (no Llama-family release uses it)")
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported; Llama-family MLPs use 'silu'")
        # Transformers 5 writes rope settings (theta included) as rope_parameters.
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position_embeddings=_context_length(raw, model_type),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always biases Q/K/V but not O; Llama's attention_bias covers all four.
            qkv_bias=attention_bias or model_type == "qwen2",
            o_proj_bias=attention_bias and model_type != "qwen2",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_scaling=_parse_rope_scaling(rope),
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
        """TP degrees that split the query heads, the KV heads and the MLP's intermediate
        width evenly (column-parallel layers shard each)."""
        sizes = (self.num_attention_heads, self.num_key_value_heads, self.intermediate_size)
        return [d for d in range(1, self.num_key_value_heads + 1) if all(n % d == 0 for n in sizes)]

    def check_tp_degree(self, tp: int, field: str = "tensor_parallel_size") -> None:
        """ValueError, naming `field` and the valid degrees, unless `tp` splits the heads
        and the MLP."""
        if tp not in self.valid_tp_degrees():
            raise ValueError(
                f"{field}={tp} does not divide the model's {self.num_attention_heads} "
                f"attention heads, {self.num_key_value_heads} KV heads and MLP width "
                f"{self.intermediate_size}; valid degrees: {self.valid_tp_degrees()}"
            )


def _context_length(raw: dict[str, Any], model_type: str) -> int:
    """The context the model runs at here. Attention here is over the whole context,
    which is what a sliding window (Mistral v0.1's 4096; Qwen2's when it turns
    use_sliding_window on) attends to as long as the sequence fits in it: the context
    stops at the window, so that output never differs from the model's own."""
    length = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window")
    if window and (model_type == "mistral" or raw.get("use_sliding_window")):
        return min(length, int(window))
    return length


def _parse_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: 'llama3')")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )
