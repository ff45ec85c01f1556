"""workers/model/parallel.py on one rank: the CPU re-layout of projection weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from workers.model import parallel
from workers.model.dense_panels import dense_panels_usable
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


def _many_row_copy(layer: parallel.PackableLinear):
    """The copy a layer keeps for batches: Baton's panels (fp32 on AVX-512) or oneDNN's."""
    assert layer.panels is None or layer.packed is None, "one many-row copy"
    return layer.panels if layer.panels is not None else layer.packed


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
        assert (_many_row_copy(layer) is not None) == (dtype == torch.float32 or onednn_bf16)
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
    # fp32 keeps a many-row copy (the panels where the CPU has AVX-512, else oneDNN's
    # blocked one) and a transposed one for single rows.
    assert (column32.panels is not None) == dense_panels_usable()
    assert _many_row_copy(column32) is not None and column32.weight_t is not None
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
        assert _many_row_copy(layer) is not None
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


# --- a GGUF's blocks (block_matmul.py) in the layers --------------------------------------


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    """A tiny model converted from a GGUF stored as Q4_1 / Q8_0, blocks kept."""
    from conftest import write_tiny_gguf

    from workers.model.gguf_import import convert_gguf

    root = tmp_path_factory.mktemp("quantized")
    write_tiny_gguf(root / "tiny.gguf", quantized=True)
    return convert_gguf(root / "tiny.gguf", root / "model")


def _linear_layers(model) -> dict[str, parallel.PackableLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, parallel.PackableLinear)}


@pytest.mark.parametrize("tp_size", [1, 2])
def test_each_rank_takes_the_blocks_of_its_own_shard(quantized_dir, tp_size):
    from workers.model.config import ModelConfig
    from workers.model.loader import load_blocks, load_weights
    from workers.model.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_pretrained(quantized_dir)
    for rank in range(tp_size):
        model = LlamaForCausalLM(cfg, TPGroup(rank, tp_size))
        load_weights(model, quantized_dir)
        load_blocks(model, quantized_dir)
        for name, layer in _linear_layers(model).items():
            if tp_size == 2 and name.endswith("down_proj"):
                # 96 input features split 48 / 48: a rank's columns would cut a block.
                assert layer.blocks is None, name
                continue
            assert layer.blocks is not None, name
            # Exact: the shard's blocks are the shard's weights.
            assert torch.equal(layer.blocks.dequantize(), layer.weight.detach()), name


def test_small_batches_run_on_the_blocks_and_compute_what_float32_does(
    quantized_dir, tmp_path, monkeypatch
):
    import shutil

    from workers.model.block_matmul import BLOCKS_FILE
    from workers.model.loader import load_model

    plain_dir = tmp_path / "plain"
    shutil.copytree(quantized_dir, plain_dir)
    shutil.rmtree((plain_dir / BLOCKS_FILE).parent)
    with_blocks, plain = load_model(quantized_dir), load_model(plain_dir)
    layers = _linear_layers(with_blocks)
    assert all(m.blocks is not None and m.weight_t is None for m in layers.values())
    assert all(m.blocks is None for m in _linear_layers(plain).values())

    calls = []
    real = parallel.WeightBlocks.matmul
    monkeypatch.setattr(
        parallel.WeightBlocks,
        "matmul",
        lambda self, x, *bits: calls.append(len(x)) or real(self, x, *bits),
    )
    head = with_blocks.lm_head
    for rows in (1, 5, 8, 9, 32, 45, 128, 129):
        hidden = torch.randn(rows, head.blocks.shape[1])
        for name, layer in layers.items():
            if name == "lm_head":
                continue
            x = torch.randn(rows, layer.blocks.shape[1])
            reference = _linear_layers(plain)[name]
            torch.testing.assert_close(layer.matmul(x), reference.matmul(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            with_blocks.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-5, atol=1e-5
        )
    # Every layer, projections and head, takes the blocks up to the CPU's limit (128
    # rows where oneDNN has AVX2, 64 with AVX-512: the kernel's row-at-a-time path to 8,
    # its outer-product path from 9, in tiles of 32 rows past 32), and the float32 copy
    # past it (the dense panels on AVX-512, oneDNN's elsewhere).
    limit = parallel.block_rows_limit()
    taken = [rows for rows in (1, 5, 8, 9, 32, 45, 128, 129) if rows <= limit]
    assert all(calls.count(rows) == len(layers) for rows in taken)
    assert set(calls) == set(taken)


@pytest.mark.skipif(not dense_panels_usable(), reason="the panels run where torch has AVX-512")
def test_a_row_is_the_same_on_either_side_of_the_block_limit(quantized_dir):
    # Up to the limit a layer with blocks runs the block kernel's outer-product path,
    # past it the float32 panels: each output is the same chain of multiply-adds, so a
    # prompt's projections do not change with the size of the chunk it came in.
    from workers.model.loader import load_model

    limit = parallel.block_rows_limit()
    layers = _linear_layers(load_model(quantized_dir))
    for name, layer in layers.items():
        assert layer.blocks is not None and layer.panels is not None, name
        x = torch.randn(limit + 1, layer.panels.panels.shape[1])
        assert torch.equal(layer.matmul(x)[:limit], layer.matmul(x[:limit])), name


def test_the_block_kernel_takes_up_to_the_rows_it_wins_at_on_the_cpu():
    from workers.model.block_matmul import block_rows_limit

    assert block_rows_limit("AVX2") == 128
    assert block_rows_limit("AVX512") == 64
    assert block_rows_limit("DEFAULT") == 128


def test_blocks_of_replaced_weights_are_not_used(quantized_dir, tmp_path, caplog):
    import shutil

    from workers.model.loader import load_model

    folder = tmp_path / "replaced"
    shutil.copytree(quantized_dir, folder)
    # A fine-tune written over the converted weights, its blocks left behind.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    model = load_model(folder)
    assert all(m.blocks is None for m in _linear_layers(model).values())
    assert "made for other weights" in caplog.text


def test_blocks_that_do_not_fit_the_weight_are_refused(quantized_dir):
    from safetensors import safe_open

    from workers.model.block_matmul import BLOCKS_FILE, BlockSource

    layer = ColumnParallelLinear(64, {"q": 32}, TPGroup.single())
    with safe_open(str(quantized_dir / BLOCKS_FILE), framework="pt") as f:
        name = "model.layers.0.self_attn.k_proj.weight"  # 32 rows of 64: fits
        layer.load_blocks(BlockSource(f, name, "q4_1"), "q")
        assert layer.blocks is not None and layer.blocks.shape == (32, 64)
        wide = RowParallelLinear(96, 64, TPGroup.single())
        wide.load_blocks(BlockSource(f, "model.layers.0.mlp.gate_proj.weight", "q4_1"))
    layer.pack()  # fits
    with pytest.raises(ValueError, match=r"do not fit the weight \(64, 96\); delete"):
        wide.pack()
