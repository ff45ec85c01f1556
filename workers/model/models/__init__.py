"""The model families, one readable module each (`llama.py`, `qwen3.py`, `qwen3_moe.py`,
`mixtral.py`, `gemma3.py`, `gemma2.py`), and the registry that picks a config's (by
`ModelConfig.family`, from its model_type; config.py refuses the model types no family
runs)."""

from __future__ import annotations

from workers.model.config import ModelConfig
from workers.model.models.causal_lm import CausalLM
from workers.model.models.gemma2 import Gemma2ForCausalLM
from workers.model.models.gemma3 import Gemma3ForCausalLM
from workers.model.models.llama import LlamaForCausalLM
from workers.model.models.mixtral import MixtralForCausalLM
from workers.model.models.qwen3 import Qwen3ForCausalLM
from workers.model.models.qwen3_moe import Qwen3MoeForCausalLM

# ModelConfig.family -> the class that runs it.
MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    return MODEL_CLASSES[cfg.family]


__all__ = [
    "CausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "model_class",
]
