"""KV handoff: block export/import and prefill engine -> decode engine.

Fast tests run small random-weight Llamas in process; the TP tests start Ray workers and
the SmolLM2 test runs the real model, both marked slow.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import replace

import pytest
import torch
from tiny_model import make_tiny_model

from workers.engine.block_hash import BlockHash
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.kv_transfer import (
    KVBlocks,
    StalePrefixError,
    export_blocks,
    import_blocks,
)
from workers.engine.model_runner import ModelRunner
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams, TokenLogprob
from workers.engine.sequence import FinishReason

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 64, **overrides}))


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (n,), generator=g).tolist()


def _drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _single(engine: LLMEngine, prompt: list[int], params=GREEDY) -> list[RequestOutput]:
    rid = f"single-{engine.stats().num_steps}"
    engine.add_request(rid, prompt, params)
    return _drain(engine)[rid]


def _prefill(prefill: LLMEngine, rid: str, prompt, params=GREEDY, salt=None) -> RequestOutput:
    prefill.add_request(rid, prompt, params, cache_salt=salt, prefill_only=True)
    (out,) = _drain(prefill)[rid]
    return out


def _handoff(prefill, decode, rid, prompt, params=GREEDY, salt=None) -> list[RequestOutput]:
    """The whole protocol; returns prefill's output followed by decode's after the first."""
    first = _prefill(prefill, rid, prompt, params, salt)
    if first.handoff is None:
        return [first]
    skip = decode.cached_prefix_blocks(list(first.handoff.block_hashes), prompt, salt)
    handle, parts = prefill.export_kv(rid, skip_blocks=skip)
    assert all(isinstance(p, KVBlocks) for p in parts)
    decode.add_prefilled_request(rid, prompt, params, handle, parts, cache_salt=salt)
    assert prefill.release_handoff(rid)
    rest = _drain(decode)[rid]
    # Decode's first output repeats the handed-over token and its text.
    assert (rest[0].new_token_ids, rest[0].new_text) == (first.new_token_ids, first.new_text)
    return [first, *rest[1:]]


def _tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def _logprobs_of(outputs: list[RequestOutput]) -> list[float]:
    return [lp.logprob for o in outputs for lp in o.new_logprobs]


def _assert_all_free(*engines: LLMEngine) -> None:
    for engine in engines:
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.handoffs_held == stats.imports_waiting == 0
        assert not engine.has_unfinished()


# -- tensors -------------------------------------------------------------------------


def _filled_runner(model_dir, seed: int, dtype=torch.float32) -> ModelRunner:
    runner = ModelRunner(model_dir, num_blocks=12, block_size=4, max_model_len=48, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return runner


def _block(cache: torch.Tensor, block: int, block_size: int = 4) -> torch.Tensor:
    return cache[:, block * block_size : (block + 1) * block_size]


def test_export_then_import_copies_exactly_those_blocks(model_dir):
    src, dst = _filled_runner(model_dir, 0), _filled_runner(model_dir, 1)
    before = [(k.clone(), v.clone()) for k, v in dst.kv_caches]
    kv = export_blocks(src, [7, 2, 9], start_block=3)
    assert kv.data.shape == (2, 2, 2, 3, 4, 16) and kv.start_block == 3 and kv.end_block == 6
    import_blocks(dst, [0, 5, 11], kv)
    for (sk, sv), (dk, dv), (bk, bv) in zip(src.kv_caches, dst.kv_caches, before, strict=True):
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
    for (sk, sv), (dk, dv) in zip(src.kv_caches, dst.kv_caches, strict=True):
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


# -- the engines -----------------------------------------------------------------------

PROMPT_LENGTHS = [1, 5, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 3 * BLOCK + 7]


def test_disaggregated_generation_matches_a_single_engine(model_dir):
    single, prefill, decode = _engine(model_dir), _engine(model_dir), _engine(model_dir)
    for i, n in enumerate(PROMPT_LENGTHS):
        prompt = _tokens(n, seed=i)
        expected = _single(single, prompt)
        got = _handoff(prefill, decode, f"r{i}", prompt)
        assert got[0].finished and got[0].finish_reason is None and got[0].handoff
        assert _tokens_of(got) == _tokens_of(expected)
        assert _logprobs_of(got) == pytest.approx(_logprobs_of(expected), abs=1e-4)
        assert got[-1].finish_reason is FinishReason.LENGTH
        assert got[-1].num_output_tokens == GREEDY.max_tokens
        assert "".join(o.new_text for o in got) == "".join(o.new_text for o in expected)
    assert prefill.stats().kv_blocks_exported == sum(-(-n // BLOCK) for n in PROMPT_LENGTHS)
    assert decode.stats().kv_blocks_imported == prefill.stats().kv_blocks_exported
    _assert_all_free(single, prefill, decode)


def test_stop_conditions_and_max_tokens_1_match_a_single_engine(model_dir):
    single, prefill, decode = _engine(model_dir), _engine(model_dir), _engine(model_dir)
    prompt = _tokens(2 * BLOCK + 3, seed=20)
    free_run = _tokens_of(_single(single, prompt))
    text = single.tokenizer.decode(free_run)
    cases = [
        SamplingParams(**{**vars(GREEDY), "stop_token_ids": [free_run[4]]}),
        SamplingParams(**{**vars(GREEDY), "stop": [text[3:6]]}),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    ]
    for i, params in enumerate(cases):
        expected = _single(single, prompt, params)
        got = _handoff(prefill, decode, f"s{i}", prompt, params)
        assert _tokens_of(got) == _tokens_of(expected)
        assert got[-1].finish_reason is expected[-1].finish_reason
        assert "".join(o.new_text for o in got) == "".join(o.new_text for o in expected)
        if params.max_tokens == 1:
            # Ends at prefill: nothing to hand off, nothing held.
            assert got[0].finish_reason is FinishReason.LENGTH and got[0].handoff is None
            assert prefill.stats().handoffs_held == 0
    _assert_all_free(single, prefill, decode)


def test_the_first_token_can_end_the_request_on_decode(model_dir):
    prefill, decode = _engine(model_dir), _engine(model_dir)
    prompt = _tokens(20, seed=21)
    first = _prefill(prefill, "r", prompt)
    handle, parts = prefill.export_kv("r")
    stop_at_once = SamplingParams(**{**vars(GREEDY), "stop_token_ids": [handle.first_token]})
    decode.add_prefilled_request("r", prompt, stop_at_once, handle, parts)
    (out,) = decode.step()
    assert out.finished and out.finish_reason is FinishReason.STOP
    assert out.new_token_ids == first.new_token_ids and out.num_output_tokens == 1
    assert prefill.release_handoff("r")
    _assert_all_free(prefill, decode)


def test_seeded_sampling_continues_the_same_random_stream(model_dir):
    single, prefill, decode = _engine(model_dir), _engine(model_dir), _engine(model_dir)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    prompt = _tokens(30, seed=22)
    assert _tokens_of(_handoff(prefill, decode, "r", prompt, params)) == _tokens_of(
        _single(single, prompt, params)
    )


def test_a_shared_prefix_is_imported_once(model_dir):
    prefill, decode = _engine(model_dir), _engine(model_dir)
    cold = _engine(model_dir, enable_prefix_caching=False)
    system = _tokens(3 * BLOCK + 5, seed=30)
    a, b = system + _tokens(9, seed=31), system + _tokens(20, seed=32)
    assert _tokens_of(_handoff(prefill, decode, "a", a)) == _tokens_of(_single(cold, a))
    stats = decode.stats()
    assert (stats.kv_blocks_imported, stats.kv_blocks_reused_for_import) == (4, 0)
    # b shares a's three full system blocks: decode holds them, prefill skips them.
    assert _tokens_of(_handoff(prefill, decode, "b", b)) == _tokens_of(_single(cold, b))
    stats = decode.stats()
    assert (stats.kv_blocks_imported, stats.kv_blocks_reused_for_import) == (4 + 2, 3)
    assert prefill.stats().kv_blocks_exported == 4 + 2
    # A prompt of whole blocks that decode holds entirely needs no K/V at all.
    whole = system[: 3 * BLOCK]
    assert _tokens_of(_handoff(prefill, decode, "w", whole)) == _tokens_of(_single(cold, whole))
    assert prefill.stats().kv_blocks_exported == 4 + 2
    assert decode.stats().kv_blocks_reused_for_import == 3 + 3
    _assert_all_free(prefill, decode)


def test_a_skip_of_blocks_decode_no_longer_holds_is_refused_and_retried(model_dir):
    prefill, decode = _engine(model_dir), _engine(model_dir)
    prompt = _tokens(3 * BLOCK + 2, seed=40)
    _prefill(prefill, "r", prompt)
    # As if decode had held two blocks when asked and evicted them since.
    handle, parts = prefill.export_kv("r", skip_blocks=2)
    with pytest.raises(StalePrefixError) as refused:
        decode.add_prefilled_request("r", prompt, GREEDY, handle, parts)
    assert refused.value.num_cached_blocks == 0
    _assert_all_free(decode)
    handle, parts = prefill.export_kv("r", skip_blocks=refused.value.num_cached_blocks)
    decode.add_prefilled_request("r", prompt, GREEDY, handle, parts)
    prefill.release_handoff("r")
    assert len(_tokens_of(_drain(decode)["r"])) == GREEDY.max_tokens
    _assert_all_free(prefill, decode)


def test_held_blocks_expire_after_the_timeout(model_dir):
    prefill = _engine(model_dir, handoff_timeout_s=0.5)
    _prefill(prefill, "r", _tokens(40, seed=50))
    stats = prefill.stats()
    assert stats.handoffs_held == 1 and stats.num_free_blocks == stats.num_total_blocks - 3
    assert not prefill.has_unfinished()  # holding is not work
    prefill.step()
    assert prefill.stats().handoffs_held == 1
    time.sleep(0.6)
    prefill.step()
    assert prefill.stats().handoffs_expired == 1
    with pytest.raises(ValueError, match="holds no KV handoff"):
        prefill.export_kv("r")
    assert not prefill.release_handoff("r")
    _assert_all_free(prefill)


def test_release_and_abort_free_held_blocks(model_dir):
    prefill = _engine(model_dir)
    for rid in ("a", "b"):
        _prefill(prefill, rid, _tokens(3 * BLOCK, seed=51))
    with pytest.raises(ValueError, match="already in use"):
        prefill.add_request("a", [5, 6], GREEDY)
    assert prefill.stats().handoffs_held == 2
    assert prefill.release_handoff("a") and not prefill.release_handoff("a")
    assert prefill.abort("b") and not prefill.abort("b")
    assert prefill.stats().handoffs_expired == 0
    # The released prompt blocks stay in the prefix cache for the next request.
    again = _prefill(prefill, "c", _tokens(3 * BLOCK, seed=51))
    assert again.num_cached_tokens == 2 * BLOCK
    prefill.release_handoff("c")
    _assert_all_free(prefill)


@pytest.mark.parametrize("skip", [-1, 3, 1.0])
def test_export_refuses_a_bad_skip(model_dir, skip):
    prefill = _engine(model_dir)
    _prefill(prefill, "r", _tokens(2 * BLOCK + 3, seed=52))
    with pytest.raises(ValueError, match="skip_blocks"):
        prefill.export_kv("r", skip_blocks=skip)


def test_an_import_waits_for_free_blocks(model_dir):
    prefill, cold = _engine(model_dir), _engine(model_dir)
    decode = _engine(model_dir, num_kv_blocks=6)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    decode.add_request("busy", _tokens(3 * BLOCK, seed=60), long)
    decode.step()  # "busy" holds 3 of the 6 blocks, and grows
    prompt = _tokens(3 * BLOCK + 1, seed=61)  # needs 4 blocks
    _prefill(prefill, "r", prompt)
    handle, parts = prefill.export_kv("r")
    decode.add_prefilled_request("r", prompt, GREEDY, handle, parts)
    assert decode.stats().imports_waiting == 1
    outputs = _drain(decode)
    assert len(_tokens_of(outputs["busy"])) == 40 - 1  # the first came before the import
    assert _tokens_of(outputs["r"]) == _tokens_of(_single(cold, prompt))
    prefill.release_handoff("r")
    # A waiting import can be aborted, giving back what it had pinned.
    decode.add_request("busy2", _tokens(3 * BLOCK, seed=60), long)
    decode.step()
    decode.add_prefilled_request("r2", prompt, GREEDY, replace(handle, request_id="r2"), parts)
    assert decode.stats().imports_waiting == 1
    assert decode.abort("r2")
    assert set(_drain(decode)) == {"busy2"}
    _assert_all_free(prefill, decode)


def test_a_waiting_import_that_fits_is_not_blocked_by_an_older_one(model_dir):
    prefill, cold = _engine(model_dir), _engine(model_dir)
    decode = _engine(model_dir, num_kv_blocks=8)
    shared = _tokens(2 * BLOCK, seed=80)
    _single(decode, [*shared, 5])  # decode now caches the two shared blocks
    busy = _tokens(2 * BLOCK + 1, seed=83)
    decode.add_request("busy", busy, SamplingParams(max_tokens=8, temperature=0.0))
    decode.step()  # "busy" holds 3 blocks, so "big" must wait
    big = _tokens(6 * BLOCK + 1, seed=81)  # 7 blocks: more than "small" ever leaves free
    small = shared + _tokens(BLOCK + 1, seed=82)  # pins the 2 cached blocks, needs 2 more
    for rid, prompt in (("big", big), ("small", small)):
        first = _prefill(prefill, rid, prompt)
        skip = decode.cached_prefix_blocks(list(first.handoff.block_hashes), prompt)
        handle, parts = prefill.export_kv(rid, skip_blocks=skip)
        decode.add_prefilled_request(rid, prompt, GREEDY, handle, parts)
        prefill.release_handoff(rid)
    assert decode.stats().imports_waiting >= 1
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(200):  # strict FIFO would never admit either: a livelock, not an error
        if not decode.has_unfinished():
            break
        for out in decode.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert _tokens_of(outputs["small"]) == _tokens_of(_single(cold, small))
    assert _tokens_of(outputs["big"]) == _tokens_of(_single(cold, big))
    _assert_all_free(prefill, decode)


def test_mismatched_handoffs_are_refused(model_dir, tmp_path):
    prefill = _engine(model_dir)
    prompt = _tokens(2 * BLOCK + 5, seed=70)
    _prefill(prefill, "r", prompt, salt="t")
    handle, parts = prefill.export_kv("r")
    other_model = make_tiny_model(tmp_path / "other", num_kv_heads=4)
    decode = _engine(model_dir)
    refused = [
        (decode, "r", prompt[:-1], handle, parts, "t", "num_tokens"),
        (decode, "x", prompt, handle, parts, "t", "request_id"),
        (decode, "r", prompt, handle, parts, None, "block_hashes"),
        (decode, "r", prompt, handle, parts[0:0], "t", "kv_parts"),
        (decode, "r", prompt, handle, [replace(parts[0], tp_size=2)], "t", "rank"),
        (decode, "r", prompt, replace(handle, tp_size=2), parts * 2, "t", "rank 0 of 1"),
        (decode, "r", prompt, replace(handle, first_token=10_000), parts, "t", "first_token"),
        (decode, "r", prompt, handle, [replace(parts[0], data=parts[0].data[:, :1])], "t", "shape"),
        (_engine(model_dir, model_id="other"), "r", prompt, handle, parts, "t", "model_id"),
        (_engine(model_dir, block_size=8), "r", prompt, handle, parts, "t", "layout"),
        # Same name, other head layout.
        (_engine(other_model, model_id=handle.model_id), "r", prompt, handle, parts, "t", "layout"),
    ]
    for engine, rid, p, h, kv, salt, field in refused:
        with pytest.raises(ValueError, match=field):
            engine.add_prefilled_request(rid, p, GREEDY, h, kv, cache_salt=salt)
        _assert_all_free(engine)
    seeded = SamplingParams(**{**vars(GREEDY), "seed": 1})
    with pytest.raises(ValueError, match="generator_state"):
        bad_state = replace(handle, generator_state=b"x")
        decode.add_prefilled_request("r", prompt, seeded, bad_state, parts, cache_salt="t")
    _assert_all_free(decode)
    # The right request still goes through.
    decode.add_prefilled_request("r", prompt, GREEDY, handle, parts, cache_salt="t")
    assert len(_tokens_of(_drain(decode)["r"])) == GREEDY.max_tokens


# -- tensor parallel (Ray) ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_tp_degrees_may_differ_between_prefill_and_decode(
    ray_cluster, model_dir, prefill_tp, decode_tp
):
    single = _engine(model_dir)
    prefill = _engine(model_dir, tensor_parallel_size=prefill_tp)
    decode = _engine(model_dir, tensor_parallel_size=decode_tp)
    try:
        system = _tokens(2 * BLOCK, seed=80)
        for i, n in enumerate([7, BLOCK, 2 * BLOCK + 9]):
            prompt = system + _tokens(n, seed=81 + i)
            expected = _single(single, prompt)
            got = _handoff(prefill, decode, f"r{i}", prompt)
            assert _tokens_of(got) == _tokens_of(expected)
            assert _logprobs_of(got) == pytest.approx(_logprobs_of(expected), abs=1e-3)
        assert decode.stats().kv_blocks_reused_for_import == 2 * 2
        _assert_all_free(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.slow
def test_smollm2_prefill_tp3_decode_tp1_matches_one_engine(ray_cluster, smollm2_dir):
    single = LLMEngine(EngineConfig(model=str(smollm2_dir), num_threads=1))
    prefill = LLMEngine(EngineConfig(model=str(smollm2_dir), tensor_parallel_size=3))
    decode = LLMEngine(EngineConfig(model=str(smollm2_dir), num_threads=1))
    tok = single.tokenizer
    params = SamplingParams(max_tokens=24, temperature=0.0)
    try:
        for i, question in enumerate(
            [
                "What is the capital of France?",
                "Write a haiku about the sea.",
                "List three prime numbers greater than ten.",
            ]
        ):
            prompt = tok.encode_chat([{"role": "user", "content": question}])
            expected = _single(single, prompt, params)
            assert _tokens_of(_handoff(prefill, decode, f"q{i}", prompt, params)) == _tokens_of(
                expected
            )
        _assert_all_free(prefill, decode)
    finally:
        prefill.shutdown()
