"""What a step tells each attention layer: its tokens' cache slots, the decoding
sequences' block tables and context lengths, and its prefill chunks.

A step's tokens come flattened: first one token per decoding sequence, then the
chunks of sequences being prefilled.

A step's metadata is one `AttentionMetadata` per KV-cache group: the groups' block
tables, and so the slots a token writes, differ. Each layer reads its own group's.

The last layer of a step that samples only some of its rows (a prefill samples from its
last token) computes the rest no further than their K/V: its metadata selects the rows
(`select_rows`), and each selected row attends as a decoding query does, to its context
in the cache, its own K/V just written. The layer's MLP then runs on those rows alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class PrefillChunk:
    """A run of `length` new tokens of one sequence, at `start` in the flat batch."""

    start: int
    length: int
    # Slots of the whole context (cached prefix + this chunk); None when the chunk
    # starts the sequence and attends only to itself.
    context_slots: torch.Tensor | None = None
    # The causal mask [length, context] over them, made by the first full-attention
    # layer that reads it (a sliding group's chunk never needs it), then kept.
    _mask: torch.Tensor | None = field(default=None, init=False, repr=False)
    # window -> (slots, mask) for sliding layers, made once per step for all of them.
    _windowed: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=dict, init=False, repr=False
    )

    def causal_mask(self) -> torch.Tensor | None:
        """[length, context], None for a chunk that starts the sequence (SDPA's is_causal)."""
        if self._mask is None and self.context_slots is not None:
            ctx, dev = self.context_slots.numel(), self.context_slots.device
            # Query i sits at context position ctx - length + i and sees keys up to
            # it; SDPA's is_causal would align the diagonal to the top-left instead.
            queries = torch.arange(ctx - self.length, ctx, device=dev)
            self._mask = torch.arange(ctx, device=dev) <= queries[:, None]
        return self._mask

    def windowed(
        self, window: int, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(slots, mask) for a sliding layer: the context from the first key any of the
        chunk's queries sees (None: the chunk's own keys), and the mask over it, None
        where the causal mask alone is the window's (a fresh chunk no longer than it)."""
        if window not in self._windowed:
            self._windowed[window] = self._window_view(window, device)
        return self._windowed[window]

    def _window_view(
        self, window: int, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.context_slots is None:
            if self.length <= window:
                return None, None
            pos = torch.arange(self.length, device=device)
            return None, _band(pos, pos, window)
        ctx = self.context_slots.numel()
        first_query = ctx - self.length
        first_key = max(0, first_query - window + 1)
        keys = torch.arange(first_key, ctx, device=device)
        queries = torch.arange(first_query, ctx, device=device)
        return self.context_slots[first_key:], _band(queries, keys, window)


def _band(queries: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """[queries, keys] True where the key is at most the query's position and within
    `window` of it (transformers' sliding mask: q - window < kv <= q)."""
    ahead = queries[:, None] - keys[None, :]
    return (ahead >= 0) & (ahead < window)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot written by each new token
    block_size: int = 16
    num_decode: int = 0
    # The decoding sequences' block tables [num_decode, max_blocks] (padded with block 0)
    # and context lengths [num_decode], this step's token included.
    decode_tables: torch.Tensor | None = None
    decode_lengths: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The rows whose outputs a layer returns (None: every row), in the step's flat order,
    # and their contexts as decoding queries (`num_decode` rows, no slots).
    selected_rows: torch.Tensor | None = None
    selected: AttentionMetadata | None = None
    _gather: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)
    _window_bias: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def select_rows(self, rows: torch.Tensor, contexts: AttentionMetadata) -> AttentionMetadata:
        """This step's metadata for a layer that returns only `rows`' outputs, whose
        contexts (block tables and lengths, their own token included) are `contexts`'."""
        if contexts.num_decode != rows.numel():
            raise RuntimeError(
                f"{rows.numel()} selected rows but contexts for {contexts.num_decode}"
            )
        return replace(self, selected_rows=rows, selected=contexts)

    def decode_gather(
        self, num_kv_heads: int, num_blocks: int, dtype: torch.dtype, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For attention by gathering (no kernel): the decoding context as rows of a
        layer's cache viewed as [kv_heads * num_blocks, block_size * head_dim] (see
        `decode_cache_rows`), and the additive mask [num_decode, max_blocks *
        block_size], 0 for context and -inf for padding (and, given a sliding
        `window`, for the keys before it). Made once for all layers."""
        if self._gather is None:
            assert self.decode_tables is not None and self.decode_lengths is not None
            tables = self.decode_tables
            pos = torch.arange(tables.shape[1] * self.block_size, device=tables.device)
            bias = torch.zeros(tables.shape[0], pos.numel(), dtype=dtype, device=tables.device)
            bias.masked_fill_(pos >= self.decode_lengths[:, None], float("-inf"))
            self._gather = decode_cache_rows(tables, num_kv_heads, num_blocks), bias
        rows, bias = self._gather
        if window is None:
            return rows, bias
        if window not in self._window_bias:
            pos = torch.arange(bias.shape[1], device=bias.device)
            before = pos < self.decode_lengths[:, None] - window
            self._window_bias[window] = bias.masked_fill(before, float("-inf"))
        return rows, self._window_bias[window]


def layer_metadata(
    num_layers: int,
    meta: list[AttentionMetadata],
    last_meta: list[AttentionMetadata] | None = None,
) -> list[list[AttentionMetadata]]:
    """Each layer's metadata: the step's, the last layer's `last_meta` where given."""
    layers = [meta] * num_layers
    if last_meta is not None and num_layers:
        layers[-1] = last_meta
    return layers


def decode_cache_rows(
    block_tables: torch.Tensor, num_kv_heads: int, num_blocks: int
) -> torch.Tensor:
    """Rows of a cache viewed as [num_kv_heads * num_blocks, block_size * head_dim] that
    hold the padded block tables [batch, max_blocks], for every KV head in turn."""
    heads = torch.arange(num_kv_heads, device=block_tables.device) * num_blocks
    return (heads[:, None] + block_tables.reshape(1, -1)).reshape(-1)
