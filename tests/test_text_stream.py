"""The router's text for token-only engine outputs equals an in-process engine's own."""

from __future__ import annotations

import pytest
from tiny_model import make_tiny_model

from serve_app.streaming.text_stream import TextStream, engine_params
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import RequestOutput, merge_outputs
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason

PROMPT = [85, 86, 81, 82, 223, 85, 86, 84, 75, 80, 73, 85]  # "stop strings"
FREE = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model_dir = str(make_tiny_model(tmp_path_factory.mktemp("tiny")))
    with_text = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64))
    tokens_only = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, detokenize=False))
    return with_text, tokens_only


def _outputs(engine: LLMEngine, params: SamplingParams) -> list[RequestOutput]:
    engine.add_request("r", PROMPT, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def _routed(engine: LLMEngine, params: SamplingParams, group: int) -> list[RequestOutput]:
    """The tokens-only engine's outputs, `group` at a time (as a lagging consumer gets
    them), through a TextStream; what the router would send."""
    outs = _outputs(engine, engine_params(params))
    stream = TextStream(engine.tokenizer.hf, PROMPT, params, sorted(engine.eos_token_ids))
    sent = []
    for i in range(0, len(outs), group):
        sent.append(stream.add(merge_outputs(outs[i : i + group])))
        if stream.stopped:
            break
    return sent


def _same(expected: list[RequestOutput], sent: list[RequestOutput]) -> None:
    def joined(outs):
        return (
            [t for o in outs for t in o.new_token_ids],
            "".join(o.new_text for o in outs),
            [lp for o in outs for lp in o.new_logprobs],
        )

    assert joined(sent) == joined(expected)
    last, want = sent[-1], expected[-1]
    assert (last.finished, last.finish_reason, last.num_output_tokens) == (
        True,
        want.finish_reason,
        want.num_output_tokens,
    )
    assert not any(o.finished for o in sent[:-1])


@pytest.mark.parametrize("group", [1, 3])
def test_text_and_a_stop_string_match_the_engine(engines, group):
    with_text, tokens_only = engines
    free = "".join(o.new_text for o in _outputs(with_text, FREE))
    # Random weights emit stray bytes (U+FFFD, decided only once the next token comes):
    # a stop string mid-output made of whole characters.
    stop = next(free[i : i + 3] for i in range(8, len(free) - 3) if "\ufffd" not in free[i : i + 3])
    params = SamplingParams(**{**vars(FREE), "stop": [stop]})
    expected = _outputs(with_text, params)
    assert expected[-1].finish_reason is FinishReason.STOP
    sent = _routed(tokens_only, params, group)
    _same(expected, sent)
    if group == 1:  # released as the engine releases it, held-back tail included
        assert [o.new_text for o in sent] == [o.new_text for o in expected]


@pytest.mark.parametrize("group", [1, 4])
def test_free_runs_and_stop_tokens_match_the_engine(engines, group):
    with_text, tokens_only = engines
    free = _outputs(with_text, FREE)
    _same(free, _routed(tokens_only, FREE, group))
    # A stop token is kept but adds no text; nothing was cut by the router.
    stop_token = free[5].new_token_ids[0]
    params = SamplingParams(**{**vars(FREE), "stop_token_ids": [stop_token]})
    expected = _outputs(with_text, params)
    assert expected[-1].new_token_ids[-1] == stop_token
    _same(expected, _routed(tokens_only, params, group))


@pytest.mark.parametrize("group", [1, 3])
def test_a_stop_string_waits_for_min_tokens_as_in_the_engine(engines, group):
    with_text, tokens_only = engines
    free = "".join(o.new_text for o in _outputs(with_text, FREE))
    stop = next(free[i : i + 3] for i in range(8, len(free) - 3) if "\ufffd" not in free[i : i + 3])
    early = _outputs(with_text, SamplingParams(**{**vars(FREE), "stop": [stop]}))
    n_early = early[-1].num_output_tokens
    params = SamplingParams(**{**vars(FREE), "stop": [stop], "min_tokens": n_early + 1})
    expected = _outputs(with_text, params)
    assert expected[-1].num_output_tokens > n_early  # the early match did not end it
    _same(expected, _routed(tokens_only, params, group))


def test_eos_matches_the_engine(engines, tmp_path):
    with_text, _ = engines
    # The same weights, with the token the model emits at step 6 declared as EOS.
    eos = _outputs(with_text, FREE)[5].new_token_ids[0]
    model_dir = str(make_tiny_model(tmp_path, eos_token_id=eos))
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=1)
    expected = _outputs(LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64)), params)
    assert expected[-1].new_token_ids[-1] == eos
    tokens_only = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, detokenize=False))
    _same(expected, _routed(tokens_only, params, 2))


def test_an_abort_keeps_the_text_of_the_tokens_before_it(engines):
    with_text, tokens_only = engines
    expected = _outputs(with_text, FREE)[:4]
    assert "".join(o.new_text for o in expected)
    outs = _outputs(tokens_only, FREE)[:4]
    aborted = RequestOutput(
        "r", [], "", finished=True, finish_reason=FinishReason.ABORT, num_output_tokens=4
    )
    stream = TextStream(tokens_only.tokenizer.hf, PROMPT, FREE, [])
    # A lagging consumer gets the tokens and the abort merged into one output.
    got = stream.add(merge_outputs([*outs, aborted]))
    assert got.new_token_ids == [t for o in expected for t in o.new_token_ids]
    assert got.new_text == "".join(o.new_text for o in expected)
    assert (got.finished, got.finish_reason) == (True, FinishReason.ABORT)


def test_a_tokens_only_engine_refuses_stop_strings(engines):
    _, tokens_only = engines
    with pytest.raises(ValueError, match="stop strings need an engine that detokenizes"):
        tokens_only.add_request("s", PROMPT, SamplingParams(stop=["x"]))
    assert not tokens_only.has_unfinished()
