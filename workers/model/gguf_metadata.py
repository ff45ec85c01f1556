"""A GGUF file's metadata, read by key; a missing required key is an error naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader

__all__ = ["GGUFMetadata"]


class GGUFMetadata:
    """The key/value metadata of one GGUF file; `arch` is its `general.architecture`."""

    def __init__(self, reader: GGUFReader, path: Path):
        self._fields = reader.fields
        self.path = path
        self.arch = str(self.get("general.architecture"))

    def get(self, key: str, default: Any = ...) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is ...:
                raise ValueError(f"{self.path}: required GGUF metadata key {key!r} is missing")
            return default
        return field.contents()

    def arch_get(self, key: str, default: Any = ...) -> Any:
        """`<architecture>.<key>`, e.g. `llama.block_count`."""
        return self.get(f"{self.arch}.{key}", default)
