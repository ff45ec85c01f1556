"""What a prefill engine tells a decode engine about a request it prefilled: `KVHandle`,
and the refusal to import an export whose skipped prefix the importer no longer holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.engine.block_hash import BlockHash
from workers.engine.sampling_params import TokenLogprob
from workers.kv.layout import KVLayout


@dataclass(frozen=True)
class KVHandle:
    """What a prefill engine hands a decode engine: small, picklable, no tensors.

    `block_hashes` are the prompt's full blocks' hashes (a trailing partial block
    is exported too but has none); the exported blocks cover `num_tokens` prompt
    tokens. The first sampled token's own K/V is not in them: decode computes it
    with its first step.
    """

    request_id: str
    model_id: str
    layout: KVLayout
    # The prefill engine's KV-head shares: one KVBlocks each. Its TP degree, unless
    # its ranks replicate KV heads (then the heads' count: workers.model.config.kv_shards).
    tp_size: int
    num_tokens: int
    block_hashes: tuple[BlockHash, ...]
    first_token: int
    first_logprob: TokenLogprob | None = None
    # The prompt's logprobs, if the request asked (prompt_logprobs.py).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # A seeded request's generator after drawing the first token, so decode
    # continues the same random stream a single engine would have.
    generator_state: bytes | None = None
    # Prompt tokens the prefill engine found in its prefix cache, so decode's outputs
    # report the request's usage, not decode's own reuse.
    num_cached_tokens: int = 0

    @property
    def num_blocks(self) -> int:
        """Blocks that hold the prompt's K/V (full ones and a trailing partial one)."""
        return -(-self.num_tokens // self.layout.block_size)


class StalePrefixError(ValueError):
    """The importer no longer holds the leading blocks the export skipped (evicted
    meanwhile); export again with `skip_blocks=num_cached_blocks`."""

    def __init__(self, message: str, num_cached_blocks: int):
        super().__init__(message)
        self.num_cached_blocks = num_cached_blocks

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps the extra field when Ray ships the exception between processes.
        return (type(self), (str(self), self.num_cached_blocks))
