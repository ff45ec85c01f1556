"""Structured output in the engine (LLMEngine, AsyncEngine): every sampled token comes from
those the request's grammar allows, on the tiny random model, whose own choices are
nearly anything; the rest of the batch, speculation and the KV handoff are unchanged."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from handoff_helpers import _engine as _handoff_engine
from handoff_helpers import _handoff, _tokens_of

from workers.engine import AsyncEngine, InvalidRequestError, SpeculativeConfig
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason
from workers.engine.structured_output import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green"]},
        "items": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "n", "tag", "items"],
    "additionalProperties": False,
}
PROMPTS = [[5, 9, 77, 100, 3], [200, 14, 14, 6], [41, 42, 43, 44, 45, 46, 47], [8]]


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256))


def _text(engine: LLMEngine, seq) -> str:
    return engine.tokenizer.decode(seq.output_token_ids)


def _sampled(spec: StructuredOutput, max_tokens: int = 80, **kw) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, structured=spec, **kw)
        for s in range(len(PROMPTS) * 3)
    ]


def test_every_sample_is_valid_under_its_json_schema_and_ends_with_it(engine):
    spec = StructuredOutput.json_schema(SCHEMA)
    seqs = engine.generate(PROMPTS * 3, _sampled(spec))
    for seq in seqs:
        jsonschema.validate(json.loads(_text(engine, seq)), SCHEMA)
        assert seq.finish_reason is FinishReason.STOP


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (StructuredOutput("regex", r"[a-c]{2,5}x[0-9]"), re.compile(r"[a-c]{2,5}x[0-9]").fullmatch),
        (
            StructuredOutput.choice(["alpha", "beta", "alphabet"]),
            {"alpha", "beta", "alphabet"}.__contains__,
        ),
        (
            StructuredOutput("grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
            re.compile(r"\([0-9]{1,2}(,[0-9]{1,2})*\)").fullmatch,
        ),
    ],
)
def test_every_sample_matches_its_regex_choice_or_grammar(engine, spec, check):
    seqs = engine.generate(PROMPTS * 3, _sampled(spec, max_tokens=200))
    texts = [_text(engine, s) for s in seqs]
    assert all(check(t) for t in texts), texts
    assert len(set(texts)) > 1  # sampled, not one forced string


def test_any_json_object_is_a_json_object(engine):
    # Free-form keys run long on a random model: a bias towards closing quotes and braces
    # ends them sooner, and the grammar still decides what is valid.
    close = {engine.tokenizer.hf.token_to_id(ch): 4.0 for ch in '"}'}
    spec = StructuredOutput("json_object")
    seqs = engine.generate(PROMPTS * 3, _sampled(spec, max_tokens=200, logit_bias=close))
    objects = [json.loads(_text(engine, s)) for s in seqs]
    assert all(isinstance(o, dict) for o in objects)
    assert any(objects)


def test_logprobs_are_of_the_masked_distribution(engine):
    params = SamplingParams(
        max_tokens=8, temperature=0.0, logprobs=5, structured=StructuredOutput.choice(["ab", "b"])
    )
    (seq,) = engine.generate([PROMPTS[0]], params)
    first = seq.output_logprobs[0]
    allowed = {engine.tokenizer.hf.token_to_id(ch) for ch in "ab"}
    assert {t for t, _ in first.top} == allowed  # 2 alternatives, not 5 with impossible ones
    assert abs(sum(pow(2.718281828459045, v) for _, v in first.top) - 1.0) < 1e-4


def test_constrained_requests_change_nothing_for_the_rest_of_the_batch(engine):
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = [s.output_token_ids for s in engine.generate(PROMPTS, plain)]
    spec = StructuredOutput.json_schema(SCHEMA)
    mixed = engine.generate(PROMPTS * 2, [plain] * 4 + _sampled(spec)[:4])
    assert [s.output_token_ids for s in mixed[:4]] == alone


def test_speculation_checks_drafts_against_the_grammar_and_changes_no_output(model_dir, engine):
    spec = StructuredOutput("regex", "(abc){12}")
    greedy = SamplingParams(max_tokens=60, temperature=0.0, structured=spec)
    seeded = SamplingParams(max_tokens=60, temperature=1.0, seed=3, structured=spec)
    plain = [s.output_token_ids for s in engine.generate(PROMPTS[:2], [greedy, seeded])]
    speculating = LLMEngine(
        EngineConfig(model=str(model_dir), num_kv_blocks=256, speculative=SpeculativeConfig(4))
    )
    drafted = [s.output_token_ids for s in speculating.generate(PROMPTS[:2], [greedy, seeded])]
    assert drafted == plain
    assert speculating.tokenizer.decode(drafted[0]) == "abc" * 12
    stats = speculating.stats()
    assert stats.num_accepted_draft_tokens > 0


def test_a_handed_off_request_continues_in_its_grammar_as_if_aggregated(model_dir, engine):
    prefill, decode = _handoff_engine(model_dir), _handoff_engine(model_dir)
    spec = StructuredOutput.json_schema(SCHEMA)
    for params in (
        SamplingParams(max_tokens=80, temperature=0.0, structured=spec),
        SamplingParams(max_tokens=80, temperature=1.0, seed=11, structured=spec),
    ):
        prompt = PROMPTS[2] * 3
        (whole,) = engine.generate([prompt], params)
        handed = _tokens_of(_handoff(prefill, decode, f"h-{params.seed}", prompt, params))
        assert handed == whole.output_token_ids
        jsonschema.validate(json.loads(engine.tokenizer.decode(handed)), SCHEMA)
    assert prefill.kv.num_free_blocks == prefill.kv.num_blocks
    assert decode.scheduler.has_work() is False


def test_a_grammar_complete_at_the_first_token_ends_the_request_at_prefill(model_dir):
    prefill = _handoff_engine(model_dir)
    (token,) = prefill.tokenizer.hf.encode("a", add_special_tokens=False).ids
    params = SamplingParams(max_tokens=10, structured=StructuredOutput.choice(["a"]))
    prefill.add_request("one", PROMPTS[0], params, prefill_only=True)
    (out,) = prefill.step()
    assert out.new_token_ids == [token] and out.finish_reason is FinishReason.STOP
    assert out.handoff is None and prefill.kv.num_free_blocks == prefill.kv.num_blocks


def test_a_spec_that_does_not_compile_is_refused_at_add_request(engine):
    spec = StructuredOutput("regex", "(unclosed", param="guided_regex")
    with pytest.raises(InvalidRequestError, match="guided_regex: .*regex") as err:
        engine.add_request("bad", PROMPTS[0], SamplingParams(structured=spec))
    assert err.value.param == "guided_regex"
    assert not engine.has_unfinished()


def test_the_async_engine_compiles_off_its_engine_thread_and_refuses_a_bad_spec(model_dir):
    async def run() -> tuple[str, BaseException]:
        engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), num_kv_blocks=64))
        try:
            spec = StructuredOutput.choice(["yes", "no"])
            params = SamplingParams(max_tokens=8, temperature=1.0, structured=spec)
            outs = [o async for o in engine.generate("ok", PROMPTS[1], params)]
            bad = StructuredOutput.json_schema({"type": "nope"}, "response_format")
            with pytest.raises(InvalidRequestError) as err:
                async for _ in engine.generate("bad", PROMPTS[1], SamplingParams(structured=bad)):
                    pass
            assert engine.is_healthy()
            return "".join(o.new_text for o in outs), err.value
        finally:
            await engine.shutdown()

    text, error = asyncio.run(run())
    assert text in ("yes", "no")
    assert error.param == "response_format" and "nope" in str(error)
