"""Prompt logprobs (workers/engine/prompt_logprobs.py) on the tiny model, against
transformers' own forward pass, through chunking, preemption, the prefix cache and a KV
handoff."""

from __future__ import annotations

import pytest
import torch
from handoff_helpers import _drain, _prefill
from tiny_model import make_tiny_model, random_prompts

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import RequestOutput, merge_outputs
from workers.engine.sampling_params import SamplingParams, TokenLogprob

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 128, **overrides}))


def _first_outputs(engine: LLMEngine, prompts, params=PARAMS) -> list[RequestOutput]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs = _drain(engine)
    return [outputs[f"r{i}"][0] for i in range(len(prompts))]


def _expected(reference, prompt: list[int], top_n: int) -> list[tuple[int, float, list[int]]]:
    with torch.no_grad():
        logprobs = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
    return [
        (prompt[i + 1], logprobs[i, prompt[i + 1]].item(), logprobs[i].topk(top_n).indices.tolist())
        for i in range(len(prompt) - 1)
    ]


def _rank_bounds(reference, prompt: list[int]) -> list[tuple[int, int]]:
    """Each target's rank under transformers' logprobs, as bounds: tokens within 1e-4 of
    it may fall on either side in another implementation's rounding."""
    with torch.no_grad():
        logprobs = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)[:-1]
    target = logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1))
    above, near = logprobs > target + 1e-4, (logprobs - target).abs() <= 1e-4
    lowest = above.sum(1) + 1
    return list(zip(lowest.tolist(), (lowest + near.sum(1) - 1).tolist(), strict=True))


def _close(got: list[TokenLogprob], expected) -> bool:
    assert [lp.token_id for lp in got] == [t for t, _, _ in expected]
    assert [[t for t, _ in lp.top] for lp in got] == [top for _, _, top in expected]
    return all(
        lp.logprob == pytest.approx(v, abs=1e-4)
        for lp, (_, v, _) in zip(got, expected, strict=True)
    )


def test_prompt_logprobs_match_transformers_forward(model_dir, reference):
    # The last prompt's 299 positions take the runner two slices (_PROMPT_ROWS).
    prompts = random_prompts(6, seed=3) + [(random_prompts(12, seed=9)[0] * 40)[:300]]
    outs = _first_outputs(_engine(model_dir), prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt) - 1
        assert _close(out.prompt_logprobs, _expected(reference, prompt, 2))
        ranks = [lp.rank for lp in out.prompt_logprobs]
        bounds = _rank_bounds(reference, prompt)
        assert all(lo <= r <= hi for r, (lo, hi) in zip(ranks, bounds, strict=True)), ranks
        # Where the target is among the top 2, its rank is its place there.
        for lp in out.prompt_logprobs:
            top = [t for t, _ in lp.top]
            assert (lp.rank <= 2) == (lp.token_id in top)
            if lp.token_id in top:
                assert lp.rank == top.index(lp.token_id) + 1


def test_only_the_first_output_carries_them_and_only_when_asked(model_dir):
    engine = _engine(model_dir)
    prompt = random_prompts(1, seed=4)[0]
    engine.add_request("asked", prompt, PARAMS)
    engine.add_request("not", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    outputs = _drain(engine)
    assert [o.prompt_logprobs is not None for o in outputs["asked"]] == [True, False, False]
    assert all(o.prompt_logprobs is None for o in outputs["not"])
    # A one-token prompt has no token with a context: an empty list, not None.
    (out,) = _first_outputs(engine, [[7]])
    assert out.prompt_logprobs == []


def test_chunked_prefill_and_preemption_record_each_position_once(model_dir):
    prompts = [p for p in random_prompts(12, seed=5) if len(p) > 20]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    whole = _first_outputs(_engine(model_dir), prompts, params)
    # A 7-token step budget cuts prompts into chunks; with 8 blocks of 16 tokens besides,
    # growing sequences preempt others, some in the middle of their prompts.
    chunked = {"max_num_batched_tokens": 7, "max_num_seqs": 7}
    for overrides in (chunked, {**chunked, "num_kv_blocks": 8}):
        engine = _engine(model_dir, **overrides)
        got = _first_outputs(engine, prompts, params)
        for a, b in zip(whole, got, strict=True):
            assert [lp.token_id for lp in b.prompt_logprobs] == [
                lp.token_id for lp in a.prompt_logprobs
            ]
            assert [lp.logprob for lp in b.prompt_logprobs] == pytest.approx(
                [lp.logprob for lp in a.prompt_logprobs], abs=1e-4
            )
    assert engine.stats().num_preemptions > 0


def test_a_cached_prefix_is_computed_again_for_them(model_dir):
    engine = _engine(model_dir)
    prompt = random_prompts(1, seed=6, vocab_size=300)[0] + list(range(10, 60))
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    (warm,) = _first_outputs(engine, [prompt], plain)
    (again,) = _first_outputs(engine, [prompt], plain)
    assert again.num_cached_tokens > 0  # the prefix is cached ...
    queries = engine.stats().prefix_cache_queries
    (asked,) = _first_outputs(engine, [prompt])
    assert asked.num_cached_tokens == 0  # ... but not taken where logprobs are due
    assert len(asked.prompt_logprobs) == len(prompt) - 1
    # Nor counted as a lookup that missed: the hit rate is the cache's.
    assert engine.stats().prefix_cache_queries == queries


def test_a_handoff_carries_them_to_decode(model_dir):
    prefill, decode = _engine(model_dir), _engine(model_dir)
    prompt = random_prompts(1, seed=7)[0] + list(range(10, 40))
    first = _prefill(prefill, "h", prompt, PARAMS)
    assert first.handoff is not None
    handle, parts = prefill.export_kv("h")
    decode.add_prefilled_request("h", prompt, PARAMS, handle, parts)
    rest = _drain(decode)["h"]
    assert rest[0].prompt_logprobs == first.prompt_logprobs
    assert len(first.prompt_logprobs) == len(prompt) - 1
    assert all(o.prompt_logprobs is None for o in rest[1:])


def test_a_handoff_without_them_is_refused_for_a_request_that_asks(model_dir):
    # As from a prefill replica of an earlier version, or given other parameters: decode
    # would have no prompt positions left to compute them from.
    prefill, decode = _engine(model_dir), _engine(model_dir)
    prompt = random_prompts(1, seed=8)[0] + list(range(10, 40))
    _prefill(prefill, "h", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    handle, parts = prefill.export_kv("h")
    with pytest.raises(ValueError, match="handle.prompt_logprobs covers 0 prompt tokens"):
        decode.add_prefilled_request("h", prompt, PARAMS, handle, parts)
    (out,) = _first_outputs(decode, [prompt])  # and decode serves on
    assert len(out.prompt_logprobs) == len(prompt) - 1


def test_merged_outputs_keep_the_first_ones_prompt_logprobs():
    lp = [TokenLogprob(5, -0.5)]
    merged = merge_outputs(
        [RequestOutput("a", [1], "x", prompt_logprobs=lp), RequestOutput("a", [2], "y")]
    )
    assert merged.prompt_logprobs == lp and merged.new_token_ids == [1, 2]
