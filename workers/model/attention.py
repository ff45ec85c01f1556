"""Attention over a paged KV cache.

The cache of one layer is two tensors `[kv_heads, num_slots, head_dim]`; slot
`block_id * block_size + offset` holds one token. A float32 cache on the CPU is
read in place by Baton's decode kernel (csrc/paged_attention.c). Elsewhere the
head-first layout makes a gathered context `[kv_heads, batch, length, head_dim]`
contiguous, which is what lets one SDPA call serve a whole decode batch with
grouped heads.

A sliding-window layer (Gemma 3's local layers) attends, for a query at position p, to
the keys at p - window + 1 .. p, as transformers' sliding mask does. Its KV-cache group
(workers/kv/kv_groups.py) holds only the blocks the window reaches; what the block
tables hold before the window is never read.

Each layer reads its own KV-cache group's metadata of the step (attention_metadata.py).
A layer whose metadata selects rows writes every row's K/V and attends for the selected
rows alone, each as a decoding query does, to its context in the cache, its own K/V
just written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import kernels
from workers.model.attention_metadata import AttentionMetadata, PrefillChunk
from workers.torch_threads import kernel_threads

# What csrc/paged_attention.c answers for a head dim or group size it does not take.
_UNSUPPORTED_SHAPE = -1


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ):
        """`scale` multiplies the scores (None: head_dim ** -0.5, SDPA's own default);
        `sliding_window` limits each query to that many keys, itself included;
        `logit_softcap` caps the scores at cap * tanh(score / cap) (Gemma 2), which SDPA
        cannot: such a layer attends by explicit softmax, as transformers' eager path."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_group = 0  # which of a step's AttentionMetadata this layer reads
        self._kernel = None  # Baton's CPU kernels, for a float32 cache on the CPU
        self._prefill_lib = None  # the same, where the prefill kernel takes the layer

    @property
    def score_scale(self) -> float:
        """What the scores are multiplied by: `scale`, or SDPA's default head_dim ** -0.5."""
        return self.head_dim**-0.5 if self.scale is None else self.scale

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_group: int = 0) -> None:
        """Binds this layer's cache buffers, addressed through group `kv_group`'s tables."""
        self.k_cache, self.v_cache, self.kv_group = k_cache, v_cache, kv_group
        on_cpu = k_cache.device.type == "cpu" and k_cache.dtype == torch.float32
        # The decode kernel has no soft-cap: a capped layer takes the gathered path.
        fits = on_cpu and self.logit_softcap is None
        self._kernel = kernels.library() if fits else None
        # The prefill kernel's shapes: head dims that are multiples of 8 up to 256, up to
        # 16 query heads per KV head (the decode kernel finds out at its first call).
        takes = self.head_dim % 8 == 0 and self.head_dim <= 256 and self.group <= 16
        self._prefill_lib = self._kernel if takes and self.sliding_window is None else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        step: list[AttentionMetadata],
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq * D], or [R, Hq * D] for the R rows
        the metadata selects; `step`: one metadata per KV-cache group."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("PagedAttention has no KV cache bound; call bind_cache first")
        meta = step[self.kv_group]
        k_heads, v_heads = k.transpose(0, 1), v.transpose(0, 1)
        self._write_cache(k, v, meta.slot_mapping)
        if meta.selected is not None:
            rows = meta.selected_rows
            return self._decode(q[rows], meta.selected).reshape(rows.numel(), -1)

        tokens = q.shape[0]
        if not meta.prefills:  # the common pure-decode step: no scatter into a buffer
            # reshape, not view: SDPA's output layout is its own (torch 2.11's CUDA SDPA
            # in float32 gave one that no view of [tokens, Hq * D] fits at batch > 1),
            # the kernel's is contiguous.
            return self._decode(q, meta).reshape(tokens, -1)
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(q[: meta.num_decode], meta)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            self._prefill(
                q[rows],
                k_heads[:, rows],
                v_heads[:, rows],
                chunk,
                meta.slot_mapping[rows],
                out[rows],
            )
        return out.view(tokens, -1)

    def _write_cache(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """cache[:, slots[t]] = k[t] (and v): through the kernel where it runs, which
        reads k and v in place (each token's heads contiguous) in one call for both."""
        in_place = all(t.stride(2) == 1 and t.stride(1) == self.head_dim for t in (k, v))
        if self._kernel is None or not in_place or slots.dtype != torch.int64:
            self.k_cache.index_copy_(1, slots, k.transpose(0, 1))
            self.v_cache.index_copy_(1, slots, v.transpose(0, 1))
            return
        status = self._kernel.baton_write_kv(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            slots.data_ptr(),
            slots.numel(),
            self.num_kv_heads,
            self.head_dim,
            self.k_cache.data_ptr(),
            self.v_cache.data_ptr(),
            self.k_cache.shape[1],
        )
        if status != 0:
            raise RuntimeError(f"a KV cache slot is out of range (status {status})")

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D]."""
        if self._kernel is not None:
            out = self._decode_kernel(q, meta)
            if out is not None:
                return out
        return self._decode_gathered(q, meta)

    def _decode_kernel(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Through csrc/paged_attention.c: each sequence's K/V read in place, through its
        block table, once for its whole group of query heads. None for a shape the
        kernel does not take (head dim not a multiple of 8 or over 256, groups over 16),
        which then stays with SDPA. A sliding layer's keys are read from the window's
        first on."""
        tables, lengths = meta.decode_tables, meta.decode_lengths
        assert tables is not None and lengths is not None
        q = q.contiguous()
        out = torch.empty_like(q)
        status = self._kernel.baton_paged_decode_attention(
            q.data_ptr(),
            self.k_cache.data_ptr(),
            self.v_cache.data_ptr(),
            self.k_cache.shape[1],
            tables.data_ptr(),
            tables.shape[1],
            lengths.data_ptr(),
            q.shape[0],
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            meta.block_size,
            self.score_scale,
            self.sliding_window or 0,
            out.data_ptr(),
            kernel_threads(),
        )
        if status == _UNSUPPORTED_SHAPE:
            self._kernel = None
            return None
        if status != 0:
            raise RuntimeError(
                f"paged decode attention refused its block tables or lengths (status {status})"
            )
        return out

    def _prefill_kernel(self, q: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Through csrc/prefill_attention.c, into `out` (contiguous, q's shape): the
        chunk's queries (the context's last) against the context's keys and values, read
        from the cache through `slots`, causally, in key blocks a query block never sees
        past."""
        if q.stride(2) != 1 or q.stride(1) != self.head_dim:
            q = q.contiguous()
        slots = slots.to(torch.int64).contiguous()
        assert out.is_contiguous() and out.shape == q.shape
        status = self._prefill_lib.baton_prefill_attention(
            q.data_ptr(),
            q.stride(0),
            q.shape[0],
            self.k_cache.data_ptr(),
            self.v_cache.data_ptr(),
            self.k_cache.shape[1],
            slots.data_ptr(),
            slots.numel(),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.score_scale,
            out.data_ptr(),
            kernel_threads(),
        )
        if status != 0:
            raise RuntimeError(f"prefill attention refused its shape or slots (status {status})")

    def _decode_gathered(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_blocks = self.k_cache.shape[1] // meta.block_size
        rows, bias = meta.decode_gather(
            self.num_kv_heads, num_blocks, self.k_cache.dtype, self.sliding_window
        )
        batch, length = bias.shape
        # Whole blocks (block_size * head_dim contiguous floats) gathered as rows of a 2-D
        # view: long contiguous copies, faster than gathering along the slot axis of the
        # 3-D cache, and far faster than gathering slot by slot.
        view = (-1, meta.block_size * self.head_dim)
        k = self.k_cache.view(view).index_select(0, rows)
        v = self.v_cache.view(view).index_select(0, rows)
        k = k.view(self.num_kv_heads, batch, length, -1)
        v = v.view(self.num_kv_heads, batch, length, -1)
        # SDPA's (batch, heads, query) axes carry (kv head, sequence, query head of
        # the group), so each group of query heads meets its own KV head.
        q = q.view(batch, self.num_kv_heads, self.group, -1).transpose(0, 1)
        mask = bias.view(1, batch, 1, length)
        out = self._attend(q, k, v, mask)
        return out.transpose(0, 1).reshape(batch, self.num_heads, -1)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool = False,
        gqa: bool = False,
    ) -> torch.Tensor:
        """SDPA, or with a soft-cap the same by explicit softmax: scores scaled, capped,
        masked (a boolean mask keeps True, an additive one adds), softmax in float32."""
        cap = self.logit_softcap
        if cap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=gqa
            )
        if gqa:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scale = self.score_scale
        scores = torch.tanh(q @ k.transpose(-1, -2) * scale / cap) * cap
        if causal:  # the diagonal top-left, as SDPA's is_causal
            n, m = scores.shape[-2:]
            mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            scores = scores + mask
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        chunk: PrefillChunk,
        chunk_slots: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """out [n, Hq, D] = attention of q [n, Hq, D] over the context, the chunk's k, v
        [Hkv, n, D] already in the cache at `chunk_slots`. The kernel writes `out` in
        place; SDPA's result is copied there."""
        if self._prefill_lib is not None and q.dtype == torch.float32:
            slots = chunk.context_slots if chunk.context_slots is not None else chunk_slots
            self._prefill_kernel(q, slots, out)
            return
        q = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if self.sliding_window is not None:
            slots, mask = chunk.windowed(self.sliding_window, q.device)
        else:
            slots, mask = chunk.context_slots, chunk.causal_mask()
        if slots is None:
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        else:
            k = self.k_cache.index_select(1, slots).unsqueeze(0)
            v = self.v_cache.index_select(1, slots).unsqueeze(0)
        causal = mask is None  # a fresh chunk: its own keys, the diagonal top-left
        out.copy_(self._attend(q, k, v, mask, causal=causal, gqa=True).squeeze(0).transpose(0, 1))
