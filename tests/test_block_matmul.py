"""The GGUF block kernel against the float32 arithmetic it stands in for."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors import safe_open
from safetensors.torch import save_file

from workers.model import block_matmul
from workers.model.block_matmul import BlockSource, WeightBlocks

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the block kernel needs AVX2",
)

_TYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
_HEAD = {"q4_1": 4, "q8_0": 2}


def gguf_blocks(weight: np.ndarray, kind: str) -> tuple[WeightBlocks, np.ndarray]:
    """`weight` quantized by gguf-py, as WeightBlocks and as gguf-py dequantizes it; for
    q8_16 (Q6_K's repacked form, which gguf-py cannot quantize), as a Q6_K file holds it:
    6-bit values minus 32 and a float32 scale per 16 weights."""
    if kind == "q8_16":
        runs = weight.reshape(weight.shape[0], -1, 16)
        scale = (np.abs(runs).max(axis=-1) / 31).astype(np.float32)
        q = np.clip(np.rint(runs / scale[..., None]), -32, 31).astype(np.int8)
        reference = (q.astype(np.float32) * scale[..., None]).reshape(weight.shape)
        qs = q.view(np.uint8).reshape(weight.shape[0], -1)
        return WeightBlocks(kind, torch.from_numpy(qs), torch.from_numpy(scale)), reference
    qtype = _TYPES[kind]
    raw = quantize(weight, qtype)
    rows, head = weight.shape[0], _HEAD[kind]
    blocks = raw.reshape(rows, -1, head + block_matmul.QS_BYTES[kind])
    scale = blocks[:, :, 0:2].copy().view("<f2").astype(np.float32)[..., 0]
    mins = blocks[:, :, 2:4].copy().view("<f2").astype(np.float32)[..., 0] if head == 4 else None
    out = WeightBlocks(
        kind,
        torch.from_numpy(np.ascontiguousarray(blocks[:, :, head:].reshape(rows, -1))),
        torch.from_numpy(scale),
        None if mins is None else torch.from_numpy(mins),
    )
    return out, dequantize(raw, qtype)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q8_16"])
def test_blocks_dequantize_as_gguf_does(kind):
    weight = np.random.default_rng(0).standard_normal((40, 96)).astype(np.float32)
    blocks, reference = gguf_blocks(weight, kind)
    assert blocks.shape == (40, 96)
    np.testing.assert_array_equal(blocks.dequantize().numpy(), reference)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q8_16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 17, 31, 32, 33, 64, 70, 100, 120])
@pytest.mark.parametrize("columns", [128, 320])
def test_matmul_equals_float32_on_the_dequantized_weight(kind, rows, columns):
    # 50 weight rows: not a whole number of the row-at-a-time path's 16-row chunks, nor
    # of the outer-product path's 48-row tasks and 3-row micro-kernels; 320 columns are
    # two 128-column slices and a remainder.
    weight = np.random.default_rng(rows).standard_normal((50, columns)).astype(np.float32)
    blocks, reference = gguf_blocks(weight, kind)
    x = torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ torch.from_numpy(reference).double().t()
    got = blocks.matmul(x)
    assert got.shape == (rows, 50) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [32, 16])
def test_no_rows_is_an_empty_product_on_a_fresh_thread(bits):
    # A long prompt's first chunk samples nothing, so the LM head gets no rows; on a
    # thread whose work team has no scratch yet (an engine's first step), that must not
    # fail the step.
    weight = np.random.default_rng(9).standard_normal((40, 64)).astype(np.float32)
    blocks, _ = gguf_blocks(weight, "q4_1")
    got: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: got.append(blocks.matmul(torch.empty(0, 64), bits)))
    thread.start()
    thread.join()
    assert len(got) == 1 and got[0].shape == (0, 40)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q8_16"])
def test_the_batched_path_multiplies_by_exactly_the_dequantized_weights(vector_width, kind):
    weight = np.random.default_rng(5).standard_normal((20, 64)).astype(np.float32)
    blocks, reference = gguf_blocks(weight, kind)
    # One-hot rows pick single weights: any dequantization that rounds differently
    # from gguf-py's (say, a fused multiply-add) shows as a mismatch.
    picked = blocks.matmul(torch.eye(64)[:24])
    np.testing.assert_array_equal(picked.numpy(), reference[:, :24].T)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q8_16"])
@pytest.mark.parametrize("weight_rows", [1, 3, 4, 18, 50])
def test_one_row_gives_each_row_of_a_batch_to_the_bit(kind, weight_rows):
    # A row's sum is the same operations in the same order however many rows share the
    # call: a sequence's logits do not depend on the batch it decodes in.
    weight = np.random.default_rng(weight_rows).standard_normal((weight_rows, 96))
    blocks, _ = gguf_blocks(weight.astype(np.float32), kind)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(weight_rows))
    batched = blocks.matmul(x)
    for row in range(3):
        assert torch.equal(blocks.matmul(x[row : row + 1])[0], batched[row]), row


@pytest.mark.parametrize("rows", [4, 20])
def test_matmul_uses_the_callers_thread_count(rows, monkeypatch):
    weight = np.random.default_rng(1).standard_normal((256, 64)).astype(np.float32)
    blocks, reference = gguf_blocks(weight, "q4_1")
    x = torch.randn(rows, 64)
    lib = block_matmul.kernels.library()
    told = []  # the thread count each call hands the kernel (its last argument)

    def recording(*args):
        told.append(args[-1])
        return lib.baton_block_matmul(*args)

    wrapped = SimpleNamespace(baton_block_matmul=recording)
    monkeypatch.setattr(block_matmul.kernels, "library", lambda: wrapped)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(blocks.matmul(x))
    finally:
        torch.set_num_threads(before)
    assert told == [1, 2]
    # Each output is one thread's sum whatever the split, so the results agree exactly.
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(outs[0], x @ torch.from_numpy(reference).t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [32, 16, 8])
def test_threads_taking_several_chunks_a_grab_cover_every_weight_row(bits):
    # 1,000 weight rows: 63 chunks of 16, the last partial; two threads take three
    # chunks a grab (block_kinds.h), so grabs end mid-weight and past its last row.
    weight = np.random.default_rng(4).standard_normal((1000, 64)).astype(np.float32)
    blocks, _ = gguf_blocks(weight, "q4_1")
    x = torch.randn(1, 64)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(blocks.matmul(x, bits))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    if bits != 32:
        expected = torch.from_numpy(_rounded_reference(blocks, x[0].numpy(), bits)).float()[None]
    else:
        expected = x @ blocks.dequantize().t()
    torch.testing.assert_close(outs[1], expected, rtol=1e-5, atol=1e-4)


def test_padded_rows_are_zero_weights():
    weight = np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32)
    blocks, _ = gguf_blocks(weight, "q8_0")
    padded = blocks.padded_rows(8)
    assert padded.shape == (8, 64)
    x = torch.randn(3, 64)
    out = padded.matmul(x)
    assert torch.equal(out[:, 5:], torch.zeros(3, 3))
    torch.testing.assert_close(out[:, :5], blocks.matmul(x), rtol=0, atol=0)


def test_cat_rows_stacks_parts_in_order():
    rng = np.random.default_rng(3)
    a, ref_a = gguf_blocks(rng.standard_normal((4, 64)).astype(np.float32), "q4_1")
    b, ref_b = gguf_blocks(rng.standard_normal((6, 64)).astype(np.float32), "q4_1")
    both = WeightBlocks.cat_rows([a, b])
    np.testing.assert_array_equal(both.dequantize().numpy(), np.concatenate([ref_a, ref_b]))


def test_bad_shapes_and_kinds_are_refused():
    blocks, _ = gguf_blocks(np.ones((4, 64), dtype=np.float32), "q8_0")
    with pytest.raises(RuntimeError, match=r"float32 \[M, 64\]"):
        blocks.matmul(torch.ones(2, 32))
    with pytest.raises(RuntimeError, match="float32"):
        blocks.matmul(torch.ones(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="q5_0"):
        WeightBlocks("q5_0", blocks.qs, blocks.scale)


def test_a_block_source_reads_row_and_block_aligned_column_slices(tmp_path):
    weight = np.random.default_rng(4).standard_normal((12, 128)).astype(np.float32)
    blocks, reference = gguf_blocks(weight, "q4_1")
    path = tmp_path / "blocks.safetensors"
    save_file({"w.qs": blocks.qs, "w.scale": blocks.scale, "w.min": blocks.min}, str(path))
    with safe_open(str(path), framework="pt") as f:
        src = BlockSource(f, "w", "q4_1")
        assert src.shape == (12, 128)
        part = src.read(slice(2, 7), columns=(32, 96))
        np.testing.assert_array_equal(part.dequantize().numpy(), reference[2:7, 32:96])
        with pytest.raises(ValueError, match="32-blocks"):
            src.read(columns=(16, 64))
        with pytest.raises(ValueError, match="block kind"):
            BlockSource(f, "w", "f16")


def _rounded_input(x: np.ndarray, bits: int) -> np.ndarray:
    """x [K] as rounded_matmul.c rounds it to `bits`, dequantized: per block of 32,
    d * rint(x * L / max|x|) with L = 2^(bits - 1) - 1 and d = max|x| / L, in float32 as
    the kernel computes it."""
    levels = np.float32(2 ** (bits - 1) - 1)
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, levels / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv)
    return (q.astype(np.float64) * (amax / levels).astype(np.float64)).reshape(-1)


def _rounded_reference(blocks: WeightBlocks, x: np.ndarray, bits: int) -> np.ndarray:
    """What the rounded kernel computes, in float64: the weights' scaled part against the
    rounded input, and (Q4_1) each block's minimum against the exact input's block sum."""
    weight = blocks.dequantize().double().numpy()
    if blocks.min is None:
        return weight @ _rounded_input(x, bits)
    mins = np.repeat(blocks.min.double().numpy(), 32, axis=1)
    return (weight - mins) @ _rounded_input(x, bits) + mins @ x.astype(np.float64)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q8_16"])
@pytest.mark.parametrize("columns", [32, 96, 576])
def test_rounded_activations_multiply_the_rounded_input(bits, kind, columns):
    rng = np.random.default_rng(columns)
    weight = rng.standard_normal((70, columns)).astype(np.float32)
    blocks, _ = gguf_blocks(weight, kind)
    x = rng.standard_normal((1, columns)).astype(np.float32) * 3
    x[0, :32] = 0  # a block of zeros: no scale to divide by
    got = blocks.matmul(torch.from_numpy(x), bits)[0].double().numpy()
    want = _rounded_reference(blocks, x[0], bits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    if bits == 16 and columns > 32:  # a rounding of its own, far finer than 8 bits'
        coarse = _rounded_reference(blocks, x[0], 8)
        assert np.abs(got - want).max() < np.abs(coarse - want).max() / 20


@pytest.mark.parametrize("bits", [16, 8])
def test_rounded_activations_take_the_full_integer_range(bits):
    """Weights of -128 and 127 against inputs at the largest steps either way: the
    largest pair sums the integer products must hold."""
    rows, columns = 4, 64
    qs = torch.tensor([-128, 127] * (rows * columns // 2), dtype=torch.int8)
    blocks = WeightBlocks("q8_0", qs.view(torch.uint8).view(rows, columns), torch.ones(rows, 2))
    x = np.tile(np.float32([-1.0, 1.0]), columns // 2)[None]
    got = blocks.matmul(torch.from_numpy(x), bits)
    torch.testing.assert_close(got, blocks.matmul(torch.from_numpy(x)), rtol=1e-6, atol=0)
    assert got[0, 0].item() == pytest.approx(255 * columns / 2, rel=1e-6)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q8_16"])
def test_rounded_activations_stay_near_the_exact_product(bits, kind):
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((256, 576)).astype(np.float32)
    blocks, _ = gguf_blocks(weight, kind)
    x = torch.from_numpy(rng.standard_normal((1, 576)).astype(np.float32))
    exact, rounded = blocks.matmul(x), blocks.matmul(x, bits)
    assert not torch.equal(exact, rounded)
    # Each element is off by up to half a step of 1/(2^(bits-1) - 1) of its block's
    # largest value; Q4_1's all-positive weights weigh those errors the most.
    assert (rounded - exact).norm() / exact.norm() < 2.0 ** (3 - bits)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_rounded_activations_leave_batches_to_the_exact_kernel(bits, kind):
    weight = np.random.default_rng(4).standard_normal((48, 128)).astype(np.float32)
    blocks, _ = gguf_blocks(weight, kind)
    for rows in (2, 8, 20):
        x = torch.randn(rows, 128)
        assert torch.equal(blocks.matmul(x, bits), blocks.matmul(x)), rows


def test_unknown_activation_bits_are_refused():
    blocks, _ = gguf_blocks(np.ones((4, 64), dtype=np.float32), "q8_0")
    with pytest.raises(ValueError, match="activation_bits must be one of"):
        blocks.matmul(torch.ones(1, 64), 4)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q8_16"])
def test_both_vector_widths_give_the_dequantized_product(vector_width, kind):
    rng = np.random.default_rng(7)
    # 70 weight rows: a 48-row task, then 22, which ends in a part micro-kernel on either
    # width (3 rows a micro-kernel on AVX2, 12 on AVX-512); from 9 rows the outer-product
    # path, whose AVX-512 form pads x to 16 rows a vector.
    weight = rng.standard_normal((70, 96)).astype(np.float32)
    blocks, reference = gguf_blocks(weight, kind)
    for rows in (1, 3, 8, 9, 16, 17, 32, 33, 64, 70):
        x = torch.from_numpy(rng.standard_normal((rows, 96)).astype(np.float32))
        want = x.double() @ torch.from_numpy(reference).double().t()
        torch.testing.assert_close(blocks.matmul(x).double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [9, 32, 33, 64, 65])
def test_the_outer_product_path_gives_the_same_bits_on_the_work_team(vector_width, rows):
    # In a small step (team_loops) up to 64 rows run on the work team, an item 48 weight
    # rows computed and committed as on OpenMP's tasks (past 64 rows still OpenMP's).
    rng = np.random.default_rng(rows)
    blocks, _ = gguf_blocks(rng.standard_normal((130, 320)).astype(np.float32), "q4_1")
    x = torch.from_numpy(rng.standard_normal((rows, 320)).astype(np.float32))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the kernels' count: a team or OpenMP loop of 2
        on_openmp = blocks.matmul(x)
        with block_matmul.kernels.team_loops():
            assert torch.equal(blocks.matmul(x), on_openmp)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q8_16"])
@pytest.mark.parametrize("rows", [9, 17, 32, 33, 70])
def test_the_outer_product_path_gives_the_same_bits_on_both_widths(kind, rows):
    # Over 8 rows each output sums the same dequantized weights times x along K in the
    # same order on either width (only how many rows a vector carries differs), so a
    # batch's logits do not depend on the CPU's vector width.
    rng = np.random.default_rng(rows)
    blocks, _ = gguf_blocks(rng.standard_normal((70, 320)).astype(np.float32), kind)
    x = torch.from_numpy(rng.standard_normal((rows, 320)).astype(np.float32))
    lib = block_matmul.kernels.library()
    try:
        lib.baton_use_avx512(0)
        narrow = blocks.matmul(x)
        lib.baton_use_avx512(1)
        assert torch.equal(blocks.matmul(x), narrow)
    finally:
        lib.baton_use_avx512(1)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q8_16"])
@pytest.mark.parametrize("columns", [32, 96, 576])  # an odd block count, then even ones
def test_both_vector_widths_round_to_16_bits_alike(vector_width, kind, columns):
    rng = np.random.default_rng(columns + 1)
    blocks, _ = gguf_blocks(rng.standard_normal((40, columns)).astype(np.float32), kind)
    x = rng.standard_normal((1, columns)).astype(np.float32) * 3
    got = blocks.matmul(torch.from_numpy(x), 16)[0].double().numpy()
    np.testing.assert_allclose(got, _rounded_reference(blocks, x[0], 16), rtol=1e-5, atol=1e-4)


def test_the_vector_width_switch_reports_what_runs():
    lib = block_matmul.kernels.library()
    try:
        assert lib.baton_use_avx512(0) == 0
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(set(line.split(":", 1)[1].split()) for line in cpuinfo if "flags" in line)
        has = {"avx512f", "avx512bw", "avx512dq"} <= flags
        assert bool(lib.baton_use_avx512(1)) == has
    finally:
        lib.baton_use_avx512(1)
