"""The model package's public face: what serving code needs of the model it serves (its
config, tokenizer and identity, the tags its tool calls come between, and where
`--model` points: a bundled model, a GGUF file or a folder)."""

from workers.model.bundled_model import BUNDLED_MODELS
from workers.model.config import ModelConfig
from workers.model.loader import model_identity
from workers.model.model_cache import ModelFetchError, ensure_default_model
from workers.model.model_source import check_model_source, resolve_model
from workers.model.tokenizer import Tokenizer, eos_token_ids
from workers.model.tool_calls import CALL_CLOSE, CALL_OPEN

__all__ = [
    "BUNDLED_MODELS",
    "CALL_CLOSE",
    "CALL_OPEN",
    "ModelConfig",
    "ModelFetchError",
    "Tokenizer",
    "check_model_source",
    "ensure_default_model",
    "eos_token_ids",
    "model_identity",
    "resolve_model",
]
