"""workers/model/parallel.py on one rank: the CPU re-layout of projection weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.model import parallel
from workers.model.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    native_bf16_matmul,
)


def _layers(dtype: torch.dtype):
    torch.manual_seed(0)
    column = ColumnParallelLinear(96, {"q": 64, "k": 32}, TPGroup.single(), bias=True, dtype=dtype)
    row = RowParallelLinear(64, 80, TPGroup.single(), dtype=dtype)
    for layer in (column, row):
        layer.weight.data.copy_(torch.randn_like(layer.weight, dtype=torch.float32) * 0.1)
        if layer.bias is not None:
            layer.bias.data.copy_(torch.randn_like(layer.bias, dtype=torch.float32))
    return column, row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7])
def test_packed_projections_compute_what_f_linear_does(dtype, rows, monkeypatch):
    # bf16 is packed wherever oneDNN can run it (emulated without AMX or AVX512-BF16), so
    # every machine checks the math of the path AMX machines take.
    onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    monkeypatch.setattr(parallel, "native_bf16_matmul", lambda: onednn_bf16)
    for layer in _layers(dtype):
        weight = layer.weight.detach().clone()
        x = torch.randn(rows, weight.shape[1]).to(dtype)
        expected = F.linear(x.float(), weight.float())
        if layer.bias is not None:
            expected += layer.bias.float()
        layer.pack()
        assert (layer.packed is not None) == (dtype == torch.float32 or onednn_bf16)
        got = layer(x)
        assert got.dtype == dtype and got.shape == expected.shape
        # bf16 keeps ~3 significant digits; the sums here are of order 1.
        atol = 1e-5 if dtype == torch.float32 else 5e-2
        assert (got.float() - expected).abs().max().item() < atol


def test_packing_is_used_where_the_cpu_has_it():
    column32, _ = _layers(torch.float32)
    column16, _ = _layers(torch.bfloat16)
    column32.pack()
    column16.pack()
    # fp32 keeps oneDNN's blocked copy and a transposed one for single rows.
    assert column32.packed is not None and column32.weight_t is not None
    assert column32.weight is None
    # bf16 is re-laid out only where the CPU multiplies bf16 natively (F.linear otherwise),
    # and then keeps only oneDNN's copy, the fastest at every row count.
    assert (column16.packed is not None) == native_bf16_matmul()
    assert column16.weight_t is None


@pytest.mark.parametrize(
    ("times", "kept"),
    [((2.0, 1.0), "packed"), ((1.0, 2.0), "transposed"), ((1.0, 0.95), "transposed")],
)
def test_the_faster_single_row_copy_is_kept_and_computes_the_same(times, kept, monkeypatch):
    layers = _layers(torch.float32)
    xs = [torch.randn(1, layer.weight.shape[1]) for layer in layers]
    expected = [layer(x) for layer, x in zip(layers, xs, strict=True)]
    for layer in layers:
        layer.pack()
    monkeypatch.setattr(parallel, "_time_single_row", lambda sample, rounds: times)
    assert parallel.keep_faster_single_row_copy(list(layers)) == kept
    for layer, x, want in zip(layers, xs, expected, strict=True):
        assert (layer.weight_t is None) == (kept == "packed")
        assert layer.packed is not None
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=0)
    # Nothing left to choose between: no copy is dropped twice, nothing is timed.
    monkeypatch.setattr(parallel, "_time_single_row", lambda sample, rounds: 1 / 0)
    if kept == "packed":
        assert parallel.keep_faster_single_row_copy(list(layers)) is None


def test_timing_a_single_row_pass_measures_both_copies():
    layers = _layers(torch.float32)
    for layer in layers:
        layer.pack()
    transposed_s, packed_s = parallel._time_single_row(list(layers), rounds=2)
    assert transposed_s > 0 and packed_s > 0
    assert parallel.keep_faster_single_row_copy(list(layers)) in ("packed", "transposed")
