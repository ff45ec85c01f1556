"""Paged attention against plain attention over each sequence's own contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.model import kernels
from workers.model.attention import PagedAttention
from workers.model.attention_metadata import AttentionMetadata, PrefillChunk, decode_cache_rows

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 6, 2, 8, 4, 16


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [n, H, D], k/v [ctx, Hkv, D] -> [n, H * D]; the last n keys are the queries'."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx) <= torch.arange(ctx - n, ctx)[:, None] if causal else None
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1).reshape(n, -1)


def test_decode_cache_rows_are_head_major_then_sequence_then_block():
    tables = torch.tensor([[3, 1], [0, 0]])
    rows = decode_cache_rows(tables, num_kv_heads=2, num_blocks=10)
    assert rows.tolist() == [3, 1, 0, 0, 13, 11, 10, 10]


def _mixed_step(attn: PagedAttention, block: int, num_blocks: int, gen: torch.Generator):
    """Runs a step of three decoding sequences and one prefill chunk after a cached
    prefix through `attn`; returns (output, expected) with the expected output from
    plain attention over each sequence's contiguous K/V."""
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    shape = (kv_heads, num_blocks * block, dim)
    attn.bind_cache(torch.zeros(shape), torch.zeros(shape))
    # Scattered, out-of-order block tables; contexts ending mid-block and on a boundary.
    per_seq = [3, 1, 2, 4]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[sum(per_seq[:i]) : sum(per_seq[: i + 1])] for i in range(4)]
    lengths = [2 * block + 2, block, 2 * block, 3 * block + 1]  # this step's token included
    chunk_len = block + 1  # the last sequence is prefilled by a chunk after a cached prefix

    def slots(table: list[int], start: int, stop: int) -> torch.Tensor:
        pos = torch.arange(start, stop)
        return torch.tensor(table)[pos // block] * block + pos % block

    k_all = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    v_all = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    cached = [n - 1 for n in lengths[:3]] + [lengths[3] - chunk_len]
    for table, n, k, v in zip(tables, cached, k_all, v_all, strict=True):
        attn.k_cache.index_copy_(1, slots(table, 0, n), k[:n].transpose(0, 1))
        attn.v_cache.index_copy_(1, slots(table, 0, n), v[:n].transpose(0, 1))

    new = [1, 1, 1, chunk_len]
    q = torch.randn(sum(new), heads, dim, generator=gen)
    k = torch.cat([ka[c:] for ka, c in zip(k_all, cached, strict=True)])
    v = torch.cat([va[c:] for va, c in zip(v_all, cached, strict=True)])
    max_blocks = max(-(-n // block) for n in lengths[:3])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(
            [slots(t, c, n) for t, c, n in zip(tables, cached, lengths, strict=True)]
        ),
        block_size=block,
        num_decode=3,
        decode_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[:3]]),
        decode_lengths=torch.tensor(lengths[:3]),
        prefills=[PrefillChunk(3, chunk_len, slots(tables[3], 0, lengths[3]))],
    )
    out = attn(q, k, v, [meta])
    expected = torch.cat(
        [
            _reference(q[start : start + new[i]], k_all[i], v_all[i], causal=True)
            for i, start in enumerate([0, 1, 2, 3])
        ]
    )
    return out, expected


needs_kernels = pytest.mark.skipif(kernels.library() is None, reason="needs Baton's CPU kernels")


@pytest.mark.parametrize("path", ["kernel", "gathered"])
def test_a_mixed_step_matches_attention_over_contiguous_context(path):
    if path == "kernel" and kernels.library() is None:
        pytest.skip("needs Baton's CPU kernels")
    attn = PagedAttention(HEADS, KV_HEADS, DIM)
    gen = torch.Generator().manual_seed(0)
    original_bind = attn.bind_cache

    def bind(k, v):
        original_bind(k, v)
        if path == "gathered":
            attn._kernel = attn._prefill_lib = None

    attn.bind_cache = bind
    out, expected = _mixed_step(attn, BLOCK, NUM_BLOCKS, gen)
    assert (attn._kernel is not None) == (attn._prefill_lib is not None) == (path == "kernel")
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block"),
    [
        (9, 3, 64, 16),  # SmolLM2's heads
        (4, 4, 128, 16),  # plain multi-head attention, the other compiled head dim
        (16, 1, 40, 48),  # multi-query, a generic head dim, blocks over 32 keys
    ],
)
def test_the_kernel_takes_common_model_shapes(heads, kv_heads, dim, block):
    attn = PagedAttention(heads, kv_heads, dim)
    out, expected = _mixed_step(attn, block, 12, torch.Generator().manual_seed(heads))
    assert attn._kernel is not None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_a_head_dim_the_kernel_does_not_take_falls_back_to_sdpa():
    attn = PagedAttention(4, 2, 12)
    out, expected = _mixed_step(attn, BLOCK, NUM_BLOCKS, torch.Generator().manual_seed(1))
    assert attn._kernel is None
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_the_kernel_gives_the_same_result_on_any_thread_count():
    gen = torch.Generator().manual_seed(2)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            attn = PagedAttention(HEADS, KV_HEADS, DIM)
            outs.append(_mixed_step(attn, BLOCK, NUM_BLOCKS, gen.manual_seed(2))[0])
    finally:
        torch.set_num_threads(before)
    # The three decode rows: each (sequence, KV head) is one thread's work either way.
    torch.testing.assert_close(outs[0][:3], outs[1][:3], rtol=0, atol=0)


@needs_kernels
def test_the_kernel_refuses_a_block_id_outside_the_cache():
    attn = PagedAttention(HEADS, KV_HEADS, DIM)
    shape = (KV_HEADS, NUM_BLOCKS * BLOCK, DIM)
    attn.bind_cache(torch.zeros(shape), torch.zeros(shape))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([1]),
        block_size=BLOCK,
        num_decode=1,
        decode_tables=torch.tensor([[NUM_BLOCKS]]),
        decode_lengths=torch.tensor([2]),
    )
    q, kv = torch.randn(1, HEADS, DIM), torch.randn(1, KV_HEADS, DIM)
    with pytest.raises(RuntimeError, match="block tables or lengths"):
        attn(q, kv, kv, [meta])


@needs_kernels
@pytest.mark.parametrize("path", ["kernel", "index_copy"])
def test_new_keys_and_values_land_in_their_slots(path):
    attn = PagedAttention(HEADS, KV_HEADS, DIM)
    shape = (KV_HEADS, NUM_BLOCKS * BLOCK, DIM)
    attn.bind_cache(torch.zeros(shape), torch.zeros(shape))
    # k and v as the model hands them over: views into one fused QKV row per token.
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(5, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(5, KV_HEADS, DIM)
    if path == "index_copy":
        k, v = k.transpose(0, 1).contiguous().transpose(0, 1), v.clone()  # heads apart
    slots = torch.tensor([7, 0, 63, 12, 13])
    attn._write_cache(k, v, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(attn.k_cache[:, slot], k[t]) and torch.equal(attn.v_cache[:, slot], v[t])
    untouched = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    untouched[slots] = False
    assert not attn.k_cache[:, untouched].any() and not attn.v_cache[:, untouched].any()


@needs_kernels
def test_a_slot_outside_the_cache_is_refused_before_anything_is_written():
    attn = PagedAttention(HEADS, KV_HEADS, DIM)
    shape = (KV_HEADS, NUM_BLOCKS * BLOCK, DIM)
    attn.bind_cache(torch.zeros(shape), torch.zeros(shape))
    kv = torch.randn(2, KV_HEADS, DIM)
    with pytest.raises(RuntimeError, match="slot is out of range"):
        attn._write_cache(kv, kv, torch.tensor([3, NUM_BLOCKS * BLOCK]))
    assert not attn.k_cache.any() and not attn.v_cache.any()


def test_a_decode_step_takes_sdpa_output_in_any_memory_layout(monkeypatch):
    # torch 2.11's CUDA SDPA in float32 returned a layout that no view of [tokens, Hq * D]
    # fits, and every pure-decode step of 2+ sequences on the gathered path (CUDA, or a
    # CPU without Baton's kernels) then failed.
    sdpa = F.scaled_dot_product_attention

    def d_major(*args, **kwargs):  # [kv, batch, group, D] stored as [batch, D, kv, group]
        return sdpa(*args, **kwargs).permute(1, 3, 0, 2).contiguous().permute(2, 0, 3, 1)

    monkeypatch.setattr("workers.model.attention.F.scaled_dot_product_attention", d_major)
    gen = torch.Generator().manual_seed(1)
    attn = PagedAttention(HEADS, KV_HEADS, DIM)
    shape = (KV_HEADS, NUM_BLOCKS * BLOCK, DIM)
    attn.bind_cache(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    attn._kernel = None
    tables, lengths = torch.tensor([[5, 2], [7, 0]]), torch.tensor([BLOCK + 2, BLOCK])
    q = torch.randn(2, HEADS, DIM, generator=gen)
    new_k, new_v = torch.randn(2, KV_HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
    slots = torch.stack(
        [
            tables[i, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
            for i, n in enumerate(lengths.tolist())
        ]
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_size=BLOCK,
        num_decode=2,
        decode_tables=tables,
        decode_lengths=lengths,
        prefills=[],
    )
    out = attn(q, new_k, new_v, [meta])
    monkeypatch.undo()  # F is torch's own module: the reference below takes plain SDPA
    for i, n in enumerate(lengths.tolist()):
        context = torch.cat([tables[i, b] * BLOCK + torch.arange(BLOCK) for b in range(2)])[:n]
        k, v = attn.k_cache[:, context].transpose(0, 1), attn.v_cache[:, context].transpose(0, 1)
        expected = _reference(q[i : i + 1], k, v, causal=False)
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)
