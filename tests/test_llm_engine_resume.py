"""A resumed request (SamplingParams.resumed_tokens): a request lost after k tokens, sent
again as prompt + those k tokens, goes on exactly as the lost one would have (greedy,
seeded sampling with penalties, a grammar, min_tokens and max_tokens), in one engine or
handed off between two, and reports usage as one request."""

from __future__ import annotations

from dataclasses import replace

import pytest
from handoff_helpers import _engine as _handoff_engine
from handoff_helpers import _handoff, _tokens_of

from workers.engine.config import EngineConfig, SpeculativeConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured_output import StructuredOutput
from workers.errors import InvalidRequestError

PROMPT = [5, 9, 77, 100, 3, 41, 42, 43]
PARAMS = [
    SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
    SamplingParams(
        max_tokens=30, temperature=0.9, seed=7, ignore_eos=True, presence_penalty=0.8,
        frequency_penalty=0.5, repetition_penalty=1.3, top_k=40,
    ),
    SamplingParams(max_tokens=30, temperature=1.0, seed=3, min_tokens=25),
    SamplingParams(
        max_tokens=60, temperature=1.0, seed=5,
        structured=StructuredOutput("regex", "(ab|cd|ef){3,12}x"),
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256))


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    rid = f"r{engine.stats().num_steps}-{len(prompt)}-{params.resumed_tokens}"
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("k", [1, 6, 17])
def test_a_resumed_request_goes_on_as_the_lost_one_would_have(engine, params, k):
    whole = _run(engine, PROMPT, params)
    tokens = _tokens_of(whole)
    assert len(tokens) > k
    rest = _run(engine, PROMPT + tokens[:k], replace(params, resumed_tokens=k))
    assert _tokens_of(rest) == tokens[k:]
    assert rest[-1].finish_reason == whole[-1].finish_reason
    # Usage as one request's: the client's prompt, and every output token.
    assert rest[-1].num_prompt_tokens == len(PROMPT)
    assert rest[-1].num_output_tokens == len(tokens)


def test_speculation_and_a_handoff_resume_the_same(model_dir, engine):
    params = PARAMS[1]
    tokens = _tokens_of(_run(engine, PROMPT, params))
    resumed = replace(params, resumed_tokens=10)
    speculating = LLMEngine(
        EngineConfig(model=str(model_dir), num_kv_blocks=256, speculative=SpeculativeConfig(3))
    )
    assert _tokens_of(_run(speculating, PROMPT + tokens[:10], resumed)) == tokens[10:]
    prefill, decode = _handoff_engine(model_dir), _handoff_engine(model_dir)
    handed = _handoff(prefill, decode, "resumed", PROMPT + tokens[:10], resumed)
    assert _tokens_of(handed) == tokens[10:]


def test_resumed_tokens_must_be_fewer_than_the_prompt_and_the_budget(engine):
    with pytest.raises(InvalidRequestError, match="resumed_tokens") as err:
        engine.add_request("x", PROMPT[:3], SamplingParams(max_tokens=9, resumed_tokens=3))
    assert err.value.param == "resumed_tokens"
    with pytest.raises(InvalidRequestError, match="resumed_tokens"):
        SamplingParams(max_tokens=4, resumed_tokens=4)
    # The context counts the client's prompt and max_tokens, the resumed output once.
    engine.add_request("fits", PROMPT, SamplingParams(max_tokens=1024 - 4, resumed_tokens=4))
    engine.abort("fits")
