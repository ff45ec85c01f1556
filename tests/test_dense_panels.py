"""workers/model/dense_panels.py: float32 matmuls against a weight laid out in panels."""

from __future__ import annotations

import pytest
import torch

from workers.model import kernels
from workers.model.block_matmul import WeightBlocks
from workers.model.dense_panels import DensePanels

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="Baton's CPU kernels need AVX2",
)

# Rows past one task's 256 (csrc/dense_matmul.c's MC), and counts that leave partial
# micro-kernels (8 rows on AVX-512, 2 on AVX2); columns that leave a partial panel of 48.
SHAPES = [(1, 96, 64), (7, 50, 33), (9, 48, 576), (300, 200, 96), (513, 97, 130)]


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().t()
    return (out if bias is None else out + bias.double()).float()


@pytest.mark.parametrize(("rows", "out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_is_the_float32_product(vector_width, rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    panels = DensePanels.pack(weight)
    assert panels.panels.shape == (-(-out_features // 48), in_features, 48)
    got = panels.matmul(x, bias)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, _reference(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_the_padding_columns_are_zero_weights():
    weight = torch.randn(50, 16)
    panels = DensePanels.pack(weight).panels
    assert torch.equal(panels[0].t(), weight[:48])
    assert torch.equal(panels[1, :, :2].t(), weight[48:])
    assert not panels[1, :, 2:].any()


def test_each_output_is_the_same_whatever_the_rows_and_threads(vector_width):
    # One chain of multiply-adds along K per output: a row's result does not depend on
    # the rows beside it, the task split or the thread count.
    weight, bias = torch.randn(200, 160), torch.randn(200)
    x = torch.randn(600, 160)
    panels = DensePanels.pack(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = panels.matmul(x, bias)
        torch.set_num_threads(1)
        alone = torch.cat([panels.matmul(x[i : i + 5], bias) for i in range(0, 600, 5)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(whole, alone)


@pytest.mark.parametrize("rows", [9, 33, 64])
def test_outputs_are_the_block_kernels_on_its_dequantized_weights(vector_width, rows):
    # Past block_rows_limit() rows a model with GGUF blocks takes the panels: a chunk's
    # outputs do not change across that boundary.
    gen = torch.Generator().manual_seed(rows)
    n, k = 100, 256
    blocks = WeightBlocks(
        "q4_1",
        torch.randint(0, 256, (n, k // 32 * 16), dtype=torch.uint8, generator=gen),
        torch.rand(n, k // 32, generator=gen) * 0.01,
        torch.rand(n, k // 32, generator=gen) * -0.05,
    )
    x = torch.randn(rows, k, generator=gen)
    assert torch.equal(DensePanels.pack(blocks.dequantize()).matmul(x), blocks.matmul(x))


@pytest.mark.parametrize("with_bias", [False, True])
def test_both_vector_widths_give_the_same_bits(with_bias):
    lib = kernels.library()
    weight, x = torch.randn(100, 70), torch.randn(21, 70)
    bias = torch.randn(100) if with_bias else None
    panels = DensePanels.pack(weight)
    try:
        lib.baton_use_avx512(0)
        narrow = panels.matmul(x, bias)
    finally:
        lib.baton_use_avx512(1)
    assert torch.equal(narrow, panels.matmul(x, bias))


def test_leading_dimensions_are_rows():
    weight, x = torch.randn(10, 8), torch.randn(2, 3, 8)
    got = DensePanels.pack(weight).matmul(x)
    assert got.shape == (2, 3, 10)
    torch.testing.assert_close(got, x @ weight.t(), rtol=1e-5, atol=1e-5)
    assert DensePanels.pack(weight).matmul(torch.empty(0, 8)).shape == (0, 10)


def test_bad_inputs_are_refused():
    panels = DensePanels.pack(torch.randn(10, 8))
    with pytest.raises(RuntimeError, match=r"float32 \[\.\.\., 8\]"):
        panels.matmul(torch.randn(3, 9))
    with pytest.raises(RuntimeError, match=r"float32 \[\.\.\., 8\]"):
        panels.matmul(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="bias"):
        panels.matmul(torch.randn(3, 8), torch.randn(9))
    with pytest.raises(RuntimeError, match="float32 .* got torch.bfloat16"):
        DensePanels.pack(torch.randn(10, 8, dtype=torch.bfloat16))
