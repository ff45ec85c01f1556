"""workers/engine/config.py: EngineConfig refuses each out-of-range field at construction,
naming it, before an engine loads anything."""

from __future__ import annotations

import math

import pytest

from workers.engine.config import EngineConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 0, r"block_size must be in \[1, 1024\], got 0"),
        ("block_size", 1025, r"block_size must be in \[1, 1024\], got 1025"),
        ("kv_cache_bytes", 0, "kv_cache_bytes must be >= 1"),
        ("num_kv_blocks", 0, "num_kv_blocks must be >= 1"),
        ("max_model_len", 0, "max_model_len must be >= 1"),
        ("dtype", "fp8", "dtype must be 'auto' or one of"),
        ("tensor_parallel_size", 0, "tensor_parallel_size must be >= 1"),
        ("tp_placement", "node", r"tp_placement must be one of \('own', 'current'\)"),
        ("num_threads", 0, "num_threads must be >= 1 or 'auto'"),
        ("num_threads", "all", "num_threads must be >= 1 or 'auto', got 'all'"),
        ("model_id", "", "model_id must be a non-empty name"),
        ("handoff_timeout_s", 0.0, "handoff_timeout_s must be > 0"),
        ("handoff_timeout_s", math.nan, "handoff_timeout_s must be > 0, got nan"),
        ("kv_transport", "gloo", "kv_transport must be one of"),
        ("max_num_seqs", 0, "max_num_seqs must be >= 1"),
        ("max_num_batched_tokens", 8, r"max_num_batched_tokens \(8\) must be >= max_num_seqs"),
        ("device", "tpu", "device must be 'auto', 'cpu' or 'cuda"),
    ],
)
def test_each_out_of_range_field_is_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **{field: value})


def test_the_defaults_and_each_fields_bounds_are_accepted():
    EngineConfig(model="m")
    EngineConfig(
        model="m",
        block_size=1024,
        num_kv_blocks=1,
        max_model_len=1,
        dtype="bfloat16",
        num_threads=1,
        model_id="x",
        handoff_timeout_s=0.001,
        max_num_seqs=1,
        max_num_batched_tokens=1,
        device="cuda:1",
        tp_placement="current",
    )
