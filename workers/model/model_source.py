"""What `--model` names, resolved to a model folder the engine loads.

A model is given as a bundled model's name (bundled_model.py; "default" is the default
one), a GGUF file (converted once into the cache) or a Hugging Face model folder
(config.json, safetensors, tokenizer.json), used as it is.
"""

from __future__ import annotations

from pathlib import Path

from workers.model.bundled_model import BUNDLED_MODELS, DEFAULT_MODEL, bundled_model
from workers.model.model_cache import converted_gguf, ensure_model

__all__ = ["check_model_source", "resolve_model"]


def check_model_source(source: str) -> None:
    """Refuse, before anything is fetched, a `model` that is none of the three forms."""
    if source == "default" or bundled_model(source) is not None:
        return
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return
    if (path / "config.json").is_file():
        return
    raise ValueError(
        f"model: {source!r} is not a bundled model ({', '.join(BUNDLED_MODELS)}), a .gguf "
        "file or a Hugging Face model folder with a config.json; pass one of those"
    )


def resolve_model(source: str | None, cache_dir: Path | None = None) -> Path:
    """The folder `source` names, fetching or converting it on first use."""
    source = source or "default"
    check_model_source(source)
    bundled = bundled_model(DEFAULT_MODEL if source == "default" else source)
    if bundled is not None:
        return ensure_model(bundled, cache_dir)
    path = Path(source).expanduser()
    if path.is_file():
        return converted_gguf(path, cache_dir)
    return path
