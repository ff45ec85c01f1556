"""KV handoff: block export/import between KV caches (copies, dtype conversion, refusals),
engines of different dtypes, and the handle and blocks surviving pickling.

Generation through a handoff is in test_handoff_disaggregated.py; holding, waiting and
refused handoffs in test_handoff_lifecycle.py.
"""

from __future__ import annotations

import pickle
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from handoff_helpers import (
    BLOCK,
    GREEDY,
    _assert_all_free,
    _engine,
    _handoff,
    _prefill,
    _tokens,
    _tokens_of,
)

from workers.engine.block_hash import BlockHash
from workers.engine.handoff.handle import StalePrefixError
from workers.engine.sampling_params import SamplingParams, TokenLogprob
from workers.engine.sequence import FinishReason
from workers.kv import cache_copy
from workers.kv.blocks import KVBlocks
from workers.kv.cache_copy import export_blocks, import_blocks
from workers.runner.model_runner import ModelRunner


def _filled_runner(model_dir, seed: int, dtype=torch.float32) -> ModelRunner:
    runner = ModelRunner(model_dir, num_blocks=12, block_size=4, max_model_len=48, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for k, v in runner.kv_cache:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return runner


def test_a_copy_past_the_parallel_size_moves_the_same_blocks(monkeypatch):
    """From PARALLEL_COPY_BYTES on a copy takes torch's threads: the same floats land."""
    cache = torch.randn(2, 2, 3, 64 * 16, 8)  # [buffers, k/v, heads, slots, dim]
    src = SimpleNamespace(kv_cache=cache, block_size=16, kv_rank=0, kv_size=1)
    dst = SimpleNamespace(kv_cache=torch.zeros_like(cache), block_size=16, kv_rank=0, kv_size=1)
    blocks = [5, 40, 2, 63]
    copies = []
    for threshold in (1 << 40, 0):  # one thread, then every copy parallel
        monkeypatch.setattr(cache_copy, "PARALLEL_COPY_BYTES", threshold)
        kv = cache_copy.export_blocks(src, blocks)
        cache_copy.import_blocks(dst, [1, 2, 3, 4], kv)
        copies.append((kv.data.clone(), dst.kv_cache.clone()))
    (one_kv, one_dst), (par_kv, par_dst) = copies
    assert torch.equal(one_kv, par_kv) and torch.equal(one_dst, par_dst)
    blocked = cache.view(2, 2, 3, 64, 16, 8)
    assert torch.equal(par_kv, blocked[:, :, :, blocks])
    assert torch.equal(par_dst.view(2, 2, 3, 64, 16, 8)[:, :, :, 1:5], blocked[:, :, :, blocks])


def _block(cache: torch.Tensor, block: int, block_size: int = 4) -> torch.Tensor:
    return cache[:, block * block_size : (block + 1) * block_size]


def test_export_then_import_copies_exactly_those_blocks(model_dir):
    src, dst = _filled_runner(model_dir, 0), _filled_runner(model_dir, 1)
    before = [(k.clone(), v.clone()) for k, v in dst.kv_cache]
    kv = export_blocks(src, [7, 2, 9], start_block=3)
    assert kv.data.shape == (2, 2, 2, 3, 4, 16) and kv.start_block == 3
    import_blocks(dst, [0, 5, 11], kv)
    for (sk, sv), (dk, dv), (bk, bv) in zip(src.kv_cache, dst.kv_cache, before, strict=True):
        for s_block, d_block in [(7, 0), (2, 5), (9, 11)]:
            assert torch.equal(_block(dk, d_block), _block(sk, s_block))
            assert torch.equal(_block(dv, d_block), _block(sv, s_block))
        for untouched in set(range(12)) - {0, 5, 11}:
            assert torch.equal(_block(dk, untouched), _block(bk, untouched))
            assert torch.equal(_block(dv, untouched), _block(bv, untouched))
    # And back again: the round trip gives the same tensor.
    assert torch.equal(export_blocks(dst, [0, 5, 11], start_block=3).data, kv.data)


@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_import_converts_the_exporters_dtype(model_dir, src_dtype, dst_dtype):
    # Pools may run different dtypes (a bf16 prefill pool, an fp32 decode pool).
    src = _filled_runner(model_dir, 0, dtype=src_dtype)
    dst = _filled_runner(model_dir, 1, dtype=dst_dtype)
    import_blocks(dst, [4, 1], export_blocks(src, [2, 8]))
    for (sk, sv), (dk, dv) in zip(src.kv_cache, dst.kv_cache, strict=True):
        assert dk.dtype == dv.dtype == dst_dtype
        for s_block, d_block in [(2, 4), (8, 1)]:
            assert torch.equal(_block(dk, d_block), _block(sk, s_block).to(dst_dtype))
            assert torch.equal(_block(dv, d_block), _block(sv, s_block).to(dst_dtype))


def test_engines_of_different_dtypes_hand_off(model_dir):
    for prefill_dtype, decode_dtype in [("bfloat16", "float32"), ("float32", "bfloat16")]:
        prefill = _engine(model_dir, dtype=prefill_dtype)
        decode = _engine(model_dir, dtype=decode_dtype)
        got = _handoff(prefill, decode, "mixed", _tokens(2 * BLOCK + 5, seed=30))
        assert len(_tokens_of(got)) == GREEDY.max_tokens
        assert got[-1].finish_reason is FinishReason.LENGTH
        assert decode.stats().kv_blocks_imported == 3
        _assert_all_free(prefill, decode)


def test_import_refuses_data_of_another_shape_or_rank(model_dir):
    runner = _filled_runner(model_dir, 0)
    kv = export_blocks(runner, [1, 2])
    with pytest.raises(ValueError, match="shape"):
        import_blocks(runner, [1, 2, 3], kv)
    with pytest.raises(ValueError, match="materialize"):
        import_blocks(runner, [1, 2], replace(kv, tp_rank=1, tp_size=2))


def test_handle_and_blocks_pickle(model_dir):
    prefill = _engine(model_dir)
    seeded = SamplingParams(max_tokens=4, temperature=1.0, seed=5, logprobs=1)
    out = _prefill(prefill, "p", _tokens(40, 1), seeded)
    handle, parts = prefill.export_kv("p")
    assert out.handoff == handle and isinstance(handle.first_logprob, TokenLogprob)
    copy, copied_parts = pickle.loads(pickle.dumps((handle, parts)))
    assert copy == handle
    assert all(isinstance(h, BlockHash) for h in copy.block_hashes)
    assert torch.equal(copied_parts[0].data, parts[0].data)
    error = pickle.loads(pickle.dumps(StalePrefixError("gone", 2)))
    assert (str(error), error.num_cached_blocks) == ("gone", 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_data_pickles_out_of_band(dtype):
    """As Ray pickles it: the data leaves as one out-of-band buffer (no bytes copied into
    the pickle), and comes back from a read-only buffer (an object store's) intact, with
    no warning."""
    data = torch.randn(2, 2, 3, 4, 16, 8).to(dtype)[:, :, 1:]  # not contiguous
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(KVBlocks(data, 1, 3, 5), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(body) < 1024
    read_only = [memoryview(bytes(b.raw())).toreadonly() for b in buffers]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy = pickle.loads(body, buffers=read_only)
    assert (copy.tp_rank, copy.tp_size, copy.start_block) == (1, 3, 5)
    assert copy.data.dtype == dtype and torch.equal(copy.data, data)
