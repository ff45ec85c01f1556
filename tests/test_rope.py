"""Rotary embeddings: the CPU kernel against the torch ops, and against the textbook."""

from __future__ import annotations

import pytest
import torch

from workers.model import kernels
from workers.model.rope import RotaryEmbedding, apply_rope

POSITIONS = torch.tensor([0, 3, 7, 100, 127])


def _fused_qk(head_dim: int) -> torch.Tensor:
    """q and k heads as a fused QKV output holds them: [T, 6 heads, D] rows of stride 8 D."""
    qkv = torch.randn(len(POSITIONS), 8 * head_dim, generator=torch.Generator().manual_seed(0))
    return qkv[:, : 6 * head_dim].view(len(POSITIONS), 6, head_dim)


@pytest.mark.skipif(kernels.library() is None, reason="needs Baton's CPU kernels")
def test_the_kernel_gives_the_torch_ops_floats(monkeypatch):
    qk = _fused_qk(64)
    assert not qk.is_contiguous()
    cos, sin = RotaryEmbedding(64, 128, 10000.0).tables(POSITIONS)
    got = apply_rope(qk, cos, sin)
    monkeypatch.setattr(kernels, "library", lambda: None)
    assert torch.equal(got, apply_rope(qk, cos, sin))


@pytest.mark.parametrize("head_dim", [64, 8])  # 8: too narrow for the kernel
def test_rope_rotates_each_half_split_pair_by_its_angle(head_dim):
    qk = _fused_qk(head_dim)
    theta = 10000.0
    cos, sin = RotaryEmbedding(head_dim, 128, theta).tables(POSITIONS)
    got = apply_rope(qk, cos, sin)
    half = head_dim // 2
    inv_freq = theta ** -(torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    angle = (POSITIONS.double()[:, None] * inv_freq)[:, None, :]
    x1, x2 = qk[..., :half].double(), qk[..., half:].double()
    expected = torch.cat(
        (x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()), dim=-1
    )
    assert got.shape == qk.shape and got.is_contiguous()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [256, 48])
def test_tables_grow_with_the_positions_seen_and_keep_the_whole_tables_floats(head_dim):
    rotary = RotaryEmbedding(head_dim, 20_000, 1_000_000.0)
    assert rotary.cos.shape[0] == 4096  # one chunk, not 20k rows
    rotary.tables(torch.tensor([5, 4095]))
    assert rotary.cos.shape[0] == 4096
    late = torch.tensor([9000, 12, 19_999])
    cos, sin = rotary.tables(late)
    assert rotary.cos.shape[0] == 20_000  # chunks up to the largest position, capped
    # The rows a table built whole at once holds, to the bit.
    freqs = torch.outer(torch.arange(20_000, dtype=torch.float32), rotary.inv_freq)
    whole_cos = torch.cat((freqs.cos(), freqs.cos()), -1)
    whole_sin = torch.cat((-freqs.sin(), freqs.sin()), -1)
    assert torch.equal(rotary.cos, whole_cos) and torch.equal(rotary.sin, whole_sin)
    assert torch.equal(cos[:, 0], whole_cos[late]) and torch.equal(sin[:, 0], whole_sin[late])
    with pytest.raises(RuntimeError, match="past 20000"):
        rotary.tables(torch.tensor([20_000]))
