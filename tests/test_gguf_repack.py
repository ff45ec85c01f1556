"""GGUF tensors repacked into the block kernel's forms change no weight.

Each repacked tensor's blocks must dequantize to exactly what gguf's own reference
dequantization gives for the stored bytes; Q4_K, which gguf cannot quantize, is checked
on random superblocks (every byte pattern is a valid one).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from workers.model.block_matmul import WeightBlocks
from workers.model.gguf_repack import repack

ROWS, COLS = 6, 512


def _random_q4_k(rng: np.random.Generator) -> np.ndarray:
    raw = rng.integers(0, 256, size=(ROWS, COLS // 256, 144), dtype=np.uint8)
    # d and dmin: finite float16s of a weight-like size (the rest is any bits at all).
    scales = rng.uniform(1e-4, 1e-2, size=(ROWS, COLS // 256, 2)).astype("<f2")
    raw[:, :, :4] = scales.view(np.uint8).reshape(ROWS, COLS // 256, 4)
    return raw.reshape(ROWS, -1)


@pytest.mark.parametrize(
    ("qtype", "kind"), [(Q.Q8_0, "q8_0"), (Q.Q4_1, "q4_1"), (Q.Q5_0, "q8_0"), (Q.Q4_K, "q4_1")]
)
def test_repacked_blocks_dequantize_exactly(qtype, kind):
    rng = np.random.default_rng(int(qtype))
    if qtype == Q.Q4_K:
        raw = _random_q4_k(rng)
    else:
        raw = quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype)
    reference = dequantize(raw, qtype).reshape(ROWS, COLS)
    got_kind, parts = repack(qtype, raw, ROWS)
    assert got_kind == kind
    blocks = WeightBlocks(
        kind, **{k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in parts.items()}
    )
    assert blocks.shape == (ROWS, COLS)
    np.testing.assert_array_equal(blocks.dequantize().numpy(), reference)


def test_q5_0_values_span_its_whole_range():
    # Extremes of the 5-bit range (q - 16 = -16 and +15) survive as int8.
    x = np.tile(np.linspace(-1.0, 1.0, 32, dtype=np.float32), (ROWS, COLS // 32))
    raw = quantize(x, Q.Q5_0)
    _, parts = repack(Q.Q5_0, raw, ROWS)
    values = parts["qs"].view(np.int8)
    assert values.min() == -16 and values.max() == 15


def test_types_without_an_exact_form_are_left_alone():
    assert repack(Q.Q6_K, np.zeros((ROWS, COLS // 256 * 210), np.uint8), ROWS) is None
    assert repack(Q.F32, np.zeros((ROWS, COLS * 4), np.uint8), ROWS) is None
