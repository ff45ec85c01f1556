"""serve_app/openai/unsupported.py: what the engine cannot do is refused naming the field,
never ignored, and its neutral values are accepted (through `openai_api.parse`, as bodies
arrive)."""

from __future__ import annotations

import pytest

from serve_app.openai.requests import ChatCompletionRequest, CompletionRequest, parse
from serve_app.openai.unsupported import UNSUPPORTED
from workers.errors import InvalidRequestError


def _chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "a"}], **fields}


def _completion(**fields):
    return {"model": "m", "prompt": "x", **fields}


@pytest.mark.parametrize(
    ("model", "field", "value", "accepted"),
    [
        (CompletionRequest, "best_of", 3, "accepted: 1"),
        (ChatCompletionRequest, "echo", True, "accepted: false"),
        (CompletionRequest, "suffix", "end", 'accepted: ""'),
        (CompletionRequest, "tools", [{"type": "function"}], "accepted: []"),
        (CompletionRequest, "tool_choice", "auto", 'accepted: "none"'),
        (CompletionRequest, "tool_choice", "required", 'accepted: "none"'),
        (ChatCompletionRequest, "functions", [{"name": "f"}], "accepted: []"),
        (ChatCompletionRequest, "function_call", "auto", 'accepted: "none"'),
        (ChatCompletionRequest, "guided_whitespace_pattern", " ", "leave it out"),
        (CompletionRequest, "use_beam_search", True, "accepted: false"),
        (ChatCompletionRequest, "include_stop_str_in_output", True, "accepted: false"),
        (ChatCompletionRequest, "bad_words", ["x"], "accepted: []"),
        (ChatCompletionRequest, "add_generation_prompt", False, "accepted: true"),
        (ChatCompletionRequest, "chat_template_kwargs", {"x": 1}, "accepted: {}"),
        (ChatCompletionRequest, "modalities", ["text", "audio"], 'accepted: ["text"]'),
    ],
)
def test_unsupported_settings_are_refused_not_ignored(model, field, value, accepted):
    body = (_chat if model is ChatCompletionRequest else _completion)(**{field: value})
    with pytest.raises(InvalidRequestError) as err:
        parse(model, body)
    assert err.value.param == field
    assert str(err.value).startswith(f"{field}: ") and accepted in str(err.value)


@pytest.mark.parametrize(
    ("model", "field"),
    [
        (model, field)
        for model in (ChatCompletionRequest, CompletionRequest)
        for field in sorted(UNSUPPORTED)
        if field not in model.model_fields  # what an endpoint serves (completions' echo)
    ],
)
def test_every_unsupported_field_is_refused_naming_itself(model, field):
    body = (_chat if model is ChatCompletionRequest else _completion)(**{field: {"x": 1}})
    with pytest.raises(InvalidRequestError) as err:
        parse(model, body)
    assert err.value.param == field and str(err.value).startswith(f"{field}: ")
    neutral = UNSUPPORTED[field][0]
    assert ("accepted: " if neutral else "leave it out") in str(err.value)


@pytest.mark.parametrize("field", sorted(f for f, (neutral, _) in UNSUPPORTED.items() if neutral))
def test_the_neutral_values_of_unsupported_fields_are_accepted(field):
    for value in UNSUPPORTED[field][0]:
        parse(ChatCompletionRequest, _chat(**{field: value}))  # raises if refused
        parse(CompletionRequest, _completion(**{field: value}))


def test_prompt_logprobs_ask_the_engine_for_the_most_either_field_shows():
    # vLLM's prompt_logprobs, alone or beside an echo's logprobs.
    for body, want in (
        (_completion(prompt_logprobs=3), 3),
        (_completion(prompt_logprobs=3, echo=True, logprobs=5), 5),
        (_completion(prompt_logprobs=4, echo=True, logprobs=1), 4),
        (_chat(prompt_logprobs=0), 0),
    ):
        model = ChatCompletionRequest if "messages" in body else CompletionRequest
        assert parse(model, body).sampling_params(room=50).prompt_logprobs == want
    for body, model in (
        (_completion(prompt_logprobs=21), CompletionRequest),
        (_chat(prompt_logprobs=-1), ChatCompletionRequest),
    ):
        with pytest.raises(InvalidRequestError) as err:
            parse(model, body)
        assert err.value.param == "prompt_logprobs"
    with pytest.raises(InvalidRequestError, match="not available with stream") as err:
        parse(CompletionRequest, _completion(prompt_logprobs=1, stream=True))
    assert err.value.param == "prompt_logprobs"


def test_completions_echo_the_prompt_and_ask_for_its_logprobs_with_logprobs():
    assert "echo" in UNSUPPORTED and "echo" not in ChatCompletionRequest.model_fields
    echo = parse(CompletionRequest, _completion(echo=True, logprobs=2))
    assert echo.sampling_params(room=50).prompt_logprobs == 2
    assert (
        parse(CompletionRequest, _completion(echo=True)).sampling_params(50).prompt_logprobs is None
    )
    assert (
        parse(CompletionRequest, _completion(logprobs=2)).sampling_params(50).prompt_logprobs
        is None
    )


def test_parallel_tool_calls_are_accepted_where_tools_are():
    parse(ChatCompletionRequest, _chat(parallel_tool_calls=True, tools=[], tool_choice="none"))
    with pytest.raises(InvalidRequestError) as err:
        parse(ChatCompletionRequest, _chat(parallel_tool_calls=True, tools=[{"type": "function"}]))
    assert err.value.param == "tools.0.function"


def test_a_refused_field_is_quoted_cut_however_deep_it_nests():
    # Quoted whole, a value nested nearly as deep as the parser takes recursed past
    # Python's limit: a 500 instead of a 400.
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(InvalidRequestError) as err:
        parse(CompletionRequest, _completion(tools=deep))
    assert err.value.param == "tools" and "got [[[" in str(err.value)
    wide = {f"k{i}": list(range(100)) for i in range(100)}
    with pytest.raises(InvalidRequestError, match="got ") as err:
        parse(ChatCompletionRequest, _chat(logits_processors=wide))
    assert len(str(err.value)) < 300
