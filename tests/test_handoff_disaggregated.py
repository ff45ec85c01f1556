"""KV handoff, prefill engine -> decode engine: the output matches one engine's (lengths,
stop conditions, seeded sampling, a shared prefix imported once, TP degrees that differ).

Fast tests run small random-weight Llamas in process; the TP tests start Ray workers and
the SmolLM2 test runs the real model, both marked slow.
"""

from __future__ import annotations

import pytest
from handoff_helpers import (
    BLOCK,
    GREEDY,
    _assert_all_free,
    _engine,
    _handoff,
    _logprobs_of,
    _prefill,
    _single,
    _tokens,
    _tokens_of,
)

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason

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
        # Penalties read the prompt and the output so far, on both sides of the handoff.
        SamplingParams(**{**vars(GREEDY), "presence_penalty": 2.0, "repetition_penalty": 3.0}),
    ]
    for i, params in enumerate(cases):
        expected = _single(single, prompt, params)
        ends_at_prefill = params.max_tokens == 1
        got = _handoff(prefill, decode, f"s{i}", prompt, params, expect_handoff=not ends_at_prefill)
        assert _tokens_of(got) == _tokens_of(expected)
        assert got[-1].finish_reason is expected[-1].finish_reason
        assert "".join(o.new_text for o in got) == "".join(o.new_text for o in expected)
        if ends_at_prefill:
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


def test_the_first_token_is_ready_before_the_step_that_computes_the_second(model_dir):
    prefill, decode = _engine(model_dir), _engine(model_dir)
    prompt = _tokens(20, seed=22)
    first = _prefill(prefill, "r", prompt)
    handle, parts = prefill.export_kv("r")
    decode.add_prefilled_request("r", prompt, GREEDY, handle, parts)
    (out,) = decode.ready_outputs()
    assert decode.stats().num_steps == 0 and not out.finished
    assert out.new_token_ids == first.new_token_ids and out.num_output_tokens == 1
    assert decode.ready_outputs() == []
    (second,) = decode.step()  # the first token is not handed out twice
    assert second.num_output_tokens == 2 and decode.stats().num_steps == 1
    assert prefill.release_handoff("r")
    decode.abort("r")
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
    # Decode's own prefix cache answered each import: its hit rate says how well.
    stats = decode.stats()
    queried = len(a) + len(b) + len(whole)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (queried, 6 * BLOCK)
    _assert_all_free(prefill, decode)


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
def test_gemma3_one_kv_head_replicated_across_tp_ranks_hands_off(ray_cluster, gemma3_dir):
    """Gemma 3 270M has one KV head: at TP 2 both ranks hold it, a handoff moves it once
    and both decode ranks import it. The long prompt (past the 512-token window) moves only
    the sliding layers' window. (Other TP degree pairs: the tiny and SmolLM2 tests here.)"""
    single = LLMEngine(EngineConfig(model=str(gemma3_dir), num_threads=1))
    prefill = LLMEngine(EngineConfig(model=str(gemma3_dir), tensor_parallel_size=2))
    decode = LLMEngine(EngineConfig(model=str(gemma3_dir), tensor_parallel_size=2))
    tok = single.tokenizer
    params = SamplingParams(max_tokens=16, temperature=0.0)
    try:
        prompts = [tok.encode(t) for t in ["The capital of France is", "Once upon a time, " * 150]]
        for i, prompt in enumerate(prompts):
            expected = _single(single, prompt, params)
            got = _handoff(prefill, decode, f"g{i}", prompt, params)
            assert _tokens_of(got) == _tokens_of(expected)
        assert len(prompts[1]) > 512 + 2 * 16
        stats = prefill.stats()
        # Of the long prompt's sliding layers, only the 512-token window's 33 blocks.
        layout = prefill.kv_layout
        assert stats.kv_blocks_exported == sum(layout.num_export_blocks(len(p), 0) for p in prompts)
        assert stats.kv_blocks_exported < stats.kv_blocks_exported_all_layers
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
