"""The model package's public face: what serving code needs of the model it serves (its
config, tokenizer and identity, and the bundled default model)."""

from workers.model.config import ModelConfig
from workers.model.default_model import ModelFetchError, ensure_default_model
from workers.model.loader import model_identity
from workers.model.tokenizer import Tokenizer, eos_token_ids

__all__ = [
    "ModelConfig",
    "ModelFetchError",
    "Tokenizer",
    "ensure_default_model",
    "eos_token_ids",
    "model_identity",
]
