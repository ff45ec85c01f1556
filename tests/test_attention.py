"""Paged attention against plain attention over each sequence's own contiguous K/V."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillChunk,
    decode_cache_rows,
)

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 6, 2, 8, 4, 16


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [n, H, D], k/v [ctx, Hkv, D] -> [n, H * D]; the last n keys are the queries'."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx) <= torch.arange(ctx - n, ctx)[:, None] if causal else None
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1).reshape(n, -1)


def _slots(table: list[int], start: int, stop: int) -> torch.Tensor:
    pos = torch.arange(start, stop)
    return torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK


def test_decode_cache_rows_are_head_major_then_sequence_then_block():
    tables = torch.tensor([[3, 1], [0, 0]])
    rows = decode_cache_rows(tables, num_kv_heads=2, num_blocks=10)
    assert rows.tolist() == [3, 1, 0, 0, 13, 11, 10, 10]


def test_a_mixed_step_matches_attention_over_contiguous_context():
    gen = torch.Generator().manual_seed(0)
    attn = PagedAttention(HEADS, KV_HEADS, DIM)
    shape = (KV_HEADS, NUM_BLOCKS * BLOCK, DIM)
    attn.bind_cache(torch.zeros(shape), torch.zeros(shape))
    # Scattered, out-of-order block tables; contexts ending mid-block and on a boundary.
    tables = [[9, 2, 14], [5], [7, 0], [11, 3, 12, 6]]
    lengths = [10, 4, 8, 13]  # context after this step, the step's own token included
    chunk_len = 5  # the last sequence is prefilled by a chunk after a cached prefix

    k_all = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
    v_all = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
    cached = [n - 1 for n in lengths[:3]] + [lengths[3] - chunk_len]
    for table, n, k, v in zip(tables, cached, k_all, v_all, strict=True):
        slots = _slots(table, 0, n)
        attn.k_cache.index_copy_(1, slots, k[:n].transpose(0, 1))
        attn.v_cache.index_copy_(1, slots, v[:n].transpose(0, 1))

    # Three decoding sequences then one prefill chunk, flattened as the runner does.
    new = [1, 1, 1, chunk_len]
    q = torch.randn(sum(new), HEADS, DIM, generator=gen)
    k = torch.cat([ka[c:] for ka, c in zip(k_all, cached, strict=True)])
    v = torch.cat([va[c:] for va, c in zip(v_all, cached, strict=True)])
    max_blocks = max(-(-n // BLOCK) for n in lengths[:3])
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[:3]])
    bias = torch.zeros(3, max_blocks * BLOCK)
    bias.masked_fill_(
        torch.arange(max_blocks * BLOCK) >= torch.tensor(lengths[:3])[:, None], -torch.inf
    )
    meta = AttentionMetadata(
        slot_mapping=torch.cat(
            [_slots(t, c, n) for t, c, n in zip(tables, cached, lengths, strict=True)]
        ),
        block_size=BLOCK,
        num_decode=3,
        decode_rows=decode_cache_rows(padded, KV_HEADS, NUM_BLOCKS),
        decode_bias=bias,
        prefills=[PrefillChunk.with_context(3, chunk_len, _slots(tables[3], 0, lengths[3]))],
    )
    out = attn(q, k, v, meta)

    for i, start in enumerate([0, 1, 2, 3]):
        rows = slice(start, start + new[i])
        expected = _reference(q[rows], k_all[i], v_all[i], causal=True)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
