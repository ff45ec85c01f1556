"""GGUF tensors repacked into the block kernel's forms change no weight.

Each repacked tensor's blocks must dequantize to exactly what gguf's own reference
dequantization gives for the stored bytes; Q4_K and Q6_K, which gguf cannot quantize,
are checked on random superblocks (every byte pattern is a valid one).
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


def _random_superblocks(rng: np.random.Generator, nbytes: int, scales_at: slice) -> np.ndarray:
    """Random K-quant superblocks of `nbytes`, their float16 super-scales (at
    `scales_at`) finite and of a weight-like size; the rest is any bits at all."""
    raw = rng.integers(0, 256, size=(ROWS, COLS // 256, nbytes), dtype=np.uint8)
    count = (scales_at.stop - scales_at.start) // 2
    scales = rng.uniform(1e-4, 1e-2, size=(ROWS, COLS // 256, count)).astype("<f2")
    raw[:, :, scales_at] = scales.view(np.uint8).reshape(ROWS, COLS // 256, 2 * count)
    return raw.reshape(ROWS, -1)


# K-quants gguf cannot quantize: (bytes per superblock, where its float16 scales sit).
_SUPERBLOCKS = {Q.Q4_K: (144, slice(0, 4)), Q.Q6_K: (210, slice(208, 210))}


@pytest.mark.parametrize(
    ("qtype", "kind"),
    [
        (Q.Q8_0, "q8_0"),
        (Q.Q4_1, "q4_1"),
        (Q.Q5_0, "q8_0"),
        (Q.Q4_K, "q4_1"),
        (Q.Q6_K, "q8_16"),
    ],
)
def test_repacked_blocks_dequantize_exactly(qtype, kind):
    rng = np.random.default_rng(int(qtype))
    if qtype in _SUPERBLOCKS:
        raw = _random_superblocks(rng, *_SUPERBLOCKS[qtype])
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
    assert repack(Q.Q5_K, np.zeros((ROWS, COLS // 256 * 176), np.uint8), ROWS) is None
    assert repack(Q.F32, np.zeros((ROWS, COLS * 4), np.uint8), ROWS) is None
