"""csrc/prefill_attention.c: a prefill chunk's causal attention over its context, read
from the paged cache through slots, against SDPA over contiguous keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.model import kernels
from workers.model.attention import PagedAttention
from workers.model.attention_metadata import AttentionMetadata, PrefillChunk

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="needs Baton's CPU kernels")


def _cache_with(k: torch.Tensor, v: torch.Tensor, gen: torch.Generator, spare: int = 7):
    """k, v [ctx, Hkv, D] scattered over a cache [Hkv, ctx + spare, D]: (k_cache,
    v_cache, slots)."""
    ctx, kv_heads, dim = k.shape
    slots = torch.randperm(ctx + spare, generator=gen)[:ctx]
    k_cache = torch.randn(kv_heads, ctx + spare, dim, generator=gen)
    v_cache = torch.randn(kv_heads, ctx + spare, dim, generator=gen)
    k_cache[:, slots] = k.transpose(0, 1)
    v_cache[:, slots] = v.transpose(0, 1)
    return k_cache, v_cache, slots


def _kernel(q, k_cache, v_cache, slots, scale, threads=2) -> torch.Tensor:
    n, heads, dim = q.shape
    out = torch.empty_like(q)
    status = kernels.library().baton_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        n,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[1],
        slots.data_ptr(),
        slots.numel(),
        heads,
        k_cache.shape[0],
        dim,
        scale,
        out.data_ptr(),
        threads,
    )
    assert status == 0
    return out


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] over k, v [ctx, Hkv, D], the queries the last n positions."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx) <= torch.arange(ctx - n, ctx)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize(
    ("n", "cached", "heads", "kv_heads", "dim"),
    [
        (1, 0, 6, 2, 8),
        (17, 0, 9, 3, 64),  # SmolLM2's heads
        (100, 0, 4, 1, 256),  # Gemma 3's
        (47, 0, 8, 8, 32),
        (13, 77, 9, 3, 64),  # after a cached prefix, ending mid key block
        (33, 31, 2, 1, 16),
        (21, 5, 4, 2, 48),  # AVX-512's last three vectors of columns apart
        (9, 40, 16, 2, 128),  # Qwen3's head size, a group of eight
        (3, 10, 9, 3, 80),  # a whole 64 columns then 16; nine rows, a group of four and one
    ],
)
def test_a_chunk_matches_causal_attention_over_its_context(
    vector_width, n, cached, heads, kv_heads, dim
):
    gen = torch.Generator().manual_seed(n + cached)
    ctx = n + cached
    q = torch.randn(n, heads, dim, generator=gen) * 2
    k = torch.randn(ctx, kv_heads, dim, generator=gen) * 2
    v = torch.randn(ctx, kv_heads, dim, generator=gen)
    k_cache, v_cache, slots = _cache_with(k, v, gen)
    got = _kernel(q, k_cache, v_cache, slots, dim**-0.5)
    torch.testing.assert_close(got, _reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_queries_may_be_rows_of_a_wider_tensor():
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(20, 12, 16, generator=gen)  # queries are heads 0-5 of each row
    q = wide[:, :6]
    k, v = torch.randn(20, 2, 16, generator=gen), torch.randn(20, 2, 16, generator=gen)
    k_cache, v_cache, slots = _cache_with(k, v, gen)
    got = _kernel(q, k_cache, v_cache, slots, 0.25)
    assert q.stride(0) == 12 * 16
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        scale=0.25,
        enable_gqa=True,
    ).transpose(0, 1)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("n", "cached"), [(70, 0), (40, 100), (5, 60)])
def test_the_same_floats_on_any_thread_count_and_on_the_work_team(vector_width, n, cached):
    # Two threads split a short chunk into smaller query blocks than one does. In a small
    # step (team_loops) a chunk of up to 64 queries (a prompt's tail after a cached
    # prefix here) runs on the work team, elsewhere up to 8; past that on OpenMP.
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(n, 9, 64, generator=gen)
    k = torch.randn(n + cached, 3, 64, generator=gen)
    v = torch.randn(n + cached, 3, 64, generator=gen)
    k_cache, v_cache, slots = _cache_with(k, v, gen)
    one = _kernel(q, k_cache, v_cache, slots, 0.125, threads=1)
    assert torch.equal(one, _kernel(q, k_cache, v_cache, slots, 0.125, threads=2))
    with kernels.team_loops():
        assert torch.equal(one, _kernel(q, k_cache, v_cache, slots, 0.125, threads=2))


def test_a_slot_outside_the_cache_or_a_shape_it_does_not_take_is_refused():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 8, generator=gen)
    k, v = torch.randn(4, 1, 8, generator=gen), torch.randn(4, 1, 8, generator=gen)
    k_cache, v_cache, slots = _cache_with(k, v, gen, spare=0)
    lib = kernels.library()
    out = torch.empty_like(q)

    def call(slots, dim=8, n=4):
        return lib.baton_prefill_attention(
            q.data_ptr(),
            16,
            n,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            4,
            slots.data_ptr(),
            slots.numel(),
            2,
            1,
            dim,
            1.0,
            out.data_ptr(),
            1,
        )

    assert call(torch.tensor([0, 1, 2, 4])) == -2  # slot 4 of 4
    assert call(torch.tensor([0, -1, 2, 3])) == -2
    assert call(slots, dim=12) == -2  # not a multiple of 8
    assert call(slots[:3], n=4) == -2  # more queries than context
    assert call(slots) == 0


def test_a_layer_prefills_through_the_kernel_as_through_sdpa():
    """A fresh chunk and one after a cached prefix, through PagedAttention: the kernel
    against the same layer on SDPA."""
    heads, kv_heads, dim, block, blocks = 9, 3, 64, 16, 12
    results = []
    for use_kernel in (True, False):
        attn = PagedAttention(heads, kv_heads, dim)
        shape = (kv_heads, blocks * block, dim)
        attn.bind_cache(torch.zeros(shape), torch.zeros(shape))
        assert attn._prefill_lib is not None
        if not use_kernel:
            attn._prefill_lib = None
        torch.manual_seed(5)
        table = torch.randperm(blocks)[:6]
        slots = table.repeat_interleave(block) * block + torch.arange(block).repeat(6)
        q = torch.randn(70, heads, dim)
        k, v = torch.randn(70, kv_heads, dim), torch.randn(70, kv_heads, dim)
        fresh = AttentionMetadata(
            slot_mapping=slots[:50], block_size=block, prefills=[PrefillChunk(0, 50)]
        )
        first = attn(q[:50], k[:50], v[:50], [fresh])
        after = AttentionMetadata(
            slot_mapping=slots[50:70],
            block_size=block,
            prefills=[PrefillChunk(0, 20, slots[:70])],
        )
        results.append((first, attn(q[50:], k[50:], v[50:], [after])))
    for got, want in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
