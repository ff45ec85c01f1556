"""OpenAI request bodies -> engine types."""

from __future__ import annotations

import pytest

from serve_app.model_frontend import PromptInput
from serve_app.openai.requests import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    choice_params,
    parse,
)
from serve_app.openai.responses import error_body
from workers.engine.sampling_params import SamplingParams, check_request
from workers.errors import InvalidRequestError

MESSAGES = [{"role": "user", "content": "a"}]


def _chat(**fields):
    return {"model": "m", "messages": MESSAGES, **fields}


def _completion(**fields):
    return {"model": "m", "prompt": "x", **fields}


def test_completion_defaults_and_fields():
    req = parse(CompletionRequest, {"model": "m", "prompt": "hi", "user": "ignored"})
    assert req.prompt_input().text == "hi"
    params = req.sampling_params(room=1000)
    assert params.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS and params.temperature == 1.0
    req = parse(
        CompletionRequest,
        {"model": "m", "prompt": [1, 2], "max_tokens": 5, "stop": "\n", "seed": 4, "top_k": 3},
    )
    assert req.prompt_input().token_ids == (1, 2)
    params = req.sampling_params(room=1000)
    assert (params.max_tokens, params.stop, params.seed, params.top_k) == (5, ("\n",), 4, 3)
    extensions = {"ignore_eos": True, "stop_token_ids": [7], "skip_special_tokens": False}
    params = parse(CompletionRequest, _completion(**extensions)).sampling_params(room=1000)
    assert (params.ignore_eos, params.stop_token_ids, params.skip_special_tokens) == (
        True,
        (7,),
        False,
    )


def test_chat_defaults_to_the_room_the_context_leaves():
    req = parse(
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
    )
    assert req.prompt_input().messages == (("user", "a"),)
    assert req.sampling_params(room=77).max_tokens == 77
    req = parse(
        ChatCompletionRequest,
        _chat(max_completion_tokens=9, logprobs=True, top_logprobs=2),
    )
    params = req.sampling_params(room=77)
    assert (params.max_tokens, params.logprobs) == (9, 2)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_completion_tokens": 7, "max_tokens": 5}, 7),
        ({"max_completion_tokens": None, "max_tokens": 5}, 5),
        ({"max_tokens": 5}, 5),
    ],
)
def test_chat_max_completion_tokens_wins_over_the_deprecated_max_tokens(fields, expected):
    req = parse(ChatCompletionRequest, _chat(**fields))
    assert req.sampling_params(room=77).max_tokens == expected


def test_completions_default_to_16_tokens_or_the_room_left():
    req = parse(CompletionRequest, _completion())
    assert req.sampling_params(room=1000).max_tokens == 16
    assert req.sampling_params(room=5).max_tokens == 5
    # No room: the check against the model then blames the prompt (test_prompts.py).
    assert req.sampling_params(room=0).max_tokens == 1


def test_a_chat_prompt_that_fills_the_context_is_blamed_not_an_unsent_max_tokens():
    chat = parse(ChatCompletionRequest, _chat())
    assert chat.sampling_params(room=0).max_tokens == 1
    with pytest.raises(InvalidRequestError) as refused:
        check_request([1] * 8, chat.sampling_params(room=0), 100, 8)
    assert chat.as_sent(refused.value).param == "messages"
    assert refused.value.code == "context_length_exceeded"
    # With a budget of its own, the engine's check names the prompt and that budget.
    assert parse(ChatCompletionRequest, _chat(max_tokens=5)).sampling_params(0).max_tokens == 5


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_penalties_min_p_and_logit_bias_reach_the_sampler(model):
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.2,
        "min_p": 0.05,
        "logit_bias": {"50256": -100, "7": 2.5},
        "min_tokens": 3,
    }
    body = (_chat if model is ChatCompletionRequest else _completion)(**fields)
    params = parse(model, body).sampling_params(room=100)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert (params.repetition_penalty, params.min_p) == (1.2, 0.05)
    assert params.logit_bias == ((7, 2.5), (50256, -100.0)) and params.min_tokens == 3


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", float("inf"), "frequency_penalty"),
        ("repetition_penalty", 0, "repetition_penalty must be in [0.01, 10]"),
        ("min_p", 1.5, "min_p must be in [0, 1]"),
        ("logit_bias", {"7": 101}, "logit_bias must map token ids to numbers in [-100, 100]"),
        ("logit_bias", {"seven": 1}, "logit_bias: keys must be token ids"),
        ("logit_bias", {" 7": 1}, "logit_bias: keys must be token ids"),
        ("logit_bias", {"1_0": 1}, "logit_bias: keys must be token ids"),
        ("logit_bias", {"\uff17": 1}, "logit_bias: keys must be token ids"),  # a wide 7
        # Past Python's int() digit limit (a 500 once); quoted cut.
        ("logit_bias", {"9" * 4301: 1}, "got '999999999999999999999...'"),
        ("logit_bias", {"1" + "0" * 19: 1}, "at most 19 digits"),
        ("logit_bias", {"7": 1, "07": -1}, "logit_bias: token 7 is named twice"),
        ("logit_bias", {"7": "1"}, "logit_bias"),
        ("min_tokens", -1, "min_tokens must be an integer in [0, max_tokens=16]"),
    ],
)
def test_out_of_range_penalties_and_biases_name_the_field(field, value, named):
    with pytest.raises(InvalidRequestError) as refused:
        parse(CompletionRequest, _completion(**{field: value})).sampling_params(room=100)
    assert refused.value.param is not None and refused.value.param.startswith(field)
    assert named in str(refused.value)


def test_null_means_the_default_for_every_optional_field():
    common = dict.fromkeys(
        ["max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed"]
        + ["presence_penalty", "frequency_penalty", "user", "top_k", "ignore_eos", "cache_salt"]
        + ["stop_token_ids", "skip_special_tokens", "logprobs", "logit_bias", "min_p"]
    )
    chat_only = dict.fromkeys(
        ["max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format"]
    )
    nulls = [
        {"role": "user", "content": "q", "name": None, "tool_calls": None},
        {"role": "assistant", "content": None, "function_call": None},
    ]
    chat = parse(ChatCompletionRequest, {**_chat(), **common, **chat_only, "messages": nulls})
    assert chat.prompt_input().messages == (("user", "q"), ("assistant", ""))
    assert chat.sampling_params(room=50) == parse(ChatCompletionRequest, _chat()).sampling_params(
        room=50
    )
    assert not chat.stream and not chat.include_usage()
    completion_only = dict.fromkeys(["echo", "suffix", "best_of"])
    req = parse(CompletionRequest, {**_completion(), **common, **completion_only})
    default = parse(CompletionRequest, _completion())
    assert req.sampling_params(room=50) == default.sampling_params(room=50)


@pytest.mark.parametrize(
    ("model", "body", "param", "says"),
    [
        (CompletionRequest, {"prompt": "x"}, "model", "required"),
        (CompletionRequest, _completion(temperature="hot"), "temperature", "number"),
        (ChatCompletionRequest, _chat(messages=[{"role": "robot"}]), "messages.0.role", "user"),
        (CompletionRequest, [1], None, "body: must be a JSON object"),
        # 0 is no budget, not "unlimited", on both endpoints.
        (ChatCompletionRequest, _chat(max_tokens=0), "max_tokens", "greater than or equal to 1"),
        (
            ChatCompletionRequest,
            _chat(max_completion_tokens=0),
            "max_completion_tokens",
            "or equal to 1",
        ),
        # ... but with echo: the prompt alone.
        (CompletionRequest, _completion(max_tokens=0), "max_tokens", "only echo: true"),
        (
            CompletionRequest,
            _completion(max_tokens=0, echo=True, min_tokens=1),
            "min_tokens",
            "must be 0 with max_tokens 0",
        ),
        (CompletionRequest, _completion(max_tokens=-1), "max_tokens", "greater than or equal"),
        # A boolean is not a number, and a number must be finite.
        (CompletionRequest, _completion(max_tokens=True), "max_tokens", "valid integer"),
        (CompletionRequest, _completion(seed=True), "seed", "valid integer"),
        (CompletionRequest, _completion(logprobs=True), "logprobs", "valid integer"),
        (CompletionRequest, _completion(stop_token_ids=[True]), "stop_token_ids.0", "integer"),
        (CompletionRequest, _completion(temperature=True), "temperature", "valid number"),
        (CompletionRequest, _completion(temperature=float("inf")), "temperature", "finite"),
        (CompletionRequest, _completion(top_p=float("nan")), "top_p", "finite"),
        (ChatCompletionRequest, _chat(logprobs=1), "logprobs", "valid boolean"),
        (CompletionRequest, _completion(stream=1), "stream", "valid boolean"),
        (ChatCompletionRequest, _chat(cache_salt=""), "cache_salt", "at least 1 character"),
        # Unions are named as a whole, not by pydantic's first branch.
        (CompletionRequest, _completion(stop=[1]), "stop", "a string or an array of strings"),
        (CompletionRequest, _completion(prompt=5), "prompt", "an array of token ids"),
        (
            ChatCompletionRequest,
            _chat(messages=[{"role": "user", "content": 5}]),
            "messages.0.content",
            "a string or an array of text parts",
        ),
        (CompletionRequest, _completion(stream=True, stream_options=5), "stream_options", "JSON"),
        (ChatCompletionRequest, _chat(top_logprobs=21, logprobs=True), "top_logprobs", "20"),
    ],
)
def test_schema_errors_name_the_field_in_the_message_and_the_param(model, body, param, says):
    with pytest.raises(InvalidRequestError) as err:
        parse(model, body)
    assert err.value.param == param
    assert str(err.value).startswith(f"{param or 'body'}: ")
    assert says in str(err.value)


def test_an_echo_of_the_prompt_alone_samples_one_token_it_does_not_return():
    req = parse(CompletionRequest, _completion(max_tokens=0, echo=True, logprobs=0))
    assert req.prompt_only
    params = req.sampling_params(room=50)
    assert (params.max_tokens, params.prompt_logprobs, params.logprobs) == (1, 0, 0)
    assert not parse(CompletionRequest, _completion(max_tokens=1, echo=True)).prompt_only


def test_negative_seeds_as_openai_takes_them_map_onto_the_engines_seeds():
    params = parse(CompletionRequest, _completion(seed=-1)).sampling_params(room=100)
    assert params.seed == 2**63 - 1
    lowest = parse(CompletionRequest, _completion(seed=-(2**63))).sampling_params(room=100)
    assert lowest.seed == 0


def test_min_tokens_raises_the_default_max_tokens_within_the_room():
    req = parse(CompletionRequest, _completion(min_tokens=40))
    assert req.sampling_params(room=100).max_tokens == 40
    with pytest.raises(InvalidRequestError) as err:
        req.sampling_params(room=30)  # the context has room for fewer than min_tokens
    assert err.value.param == "min_tokens"


def test_top_logprobs_need_logprobs():
    with pytest.raises(InvalidRequestError, match="top_logprobs: requires logprobs: true") as err:
        parse(ChatCompletionRequest, _chat(top_logprobs=2))
    assert err.value.param == "top_logprobs"
    assert parse(ChatCompletionRequest, _chat(top_logprobs=0)).sampling_params(5).logprobs is None
    req = parse(ChatCompletionRequest, _chat(logprobs=True))
    assert req.sampling_params(room=5).logprobs == 0


def test_stream_options_need_a_stream():
    for stream in ({}, {"stream": False}):
        with pytest.raises(InvalidRequestError, match="only allowed when stream is true") as err:
            parse(CompletionRequest, _completion(**stream, stream_options={"include_usage": True}))
        assert err.value.param == "stream_options"
    req = parse(ChatCompletionRequest, _chat(stream=True, stream_options={"include_usage": True}))
    assert req.include_usage()
    assert not parse(ChatCompletionRequest, _chat(stream=True)).include_usage()


def test_vllms_usage_in_every_chunk_is_refused_not_ignored():
    off = {"include_usage": True, "continuous_usage_stats": False}
    assert parse(CompletionRequest, _completion(stream=True, stream_options=off)).include_usage()
    on = {"continuous_usage_stats": True}
    with pytest.raises(InvalidRequestError, match="accepted: false") as err:
        parse(CompletionRequest, _completion(stream=True, stream_options=on))
    assert err.value.param == "stream_options.continuous_usage_stats"


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"top_p": 2}, "top_p", "(0, 1]"),
        ({"temperature": -1}, "temperature", "[0, 100]"),
        ({"top_k": -2}, "top_k", "in [-1, 2147483647]"),
        ({"seed": 2**63}, "seed", "[0, 2**63)"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ],
)
def test_the_engines_range_errors_name_the_field(fields, param, says):
    req = parse(CompletionRequest, _completion(**fields))
    with pytest.raises(InvalidRequestError) as err:
        req.sampling_params(room=100)
    assert err.value.param == param and says in str(err.value)


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ([{"type": "image_url", "image_url": {"url": "x"}}], "messages.0.content.0"),
        ([{"type": "text", "text": None}], "messages.0.content.0.text"),
    ],
)
def test_chat_content_parts_must_be_text(content, param):
    req = parse(ChatCompletionRequest, _chat(messages=[{"role": "user", "content": content}]))
    with pytest.raises(InvalidRequestError) as err:
        req.prompt_input()
    assert err.value.param == param and str(err.value).startswith(f"{param}: ")


def test_a_batch_of_prompts_is_one_prompt_input_each_and_bounded():
    req = parse(CompletionRequest, _completion(prompt=["a", "b"], n=2))
    assert req.prompt_inputs() == [PromptInput(text="a"), PromptInput(text="b")]
    req = parse(CompletionRequest, _completion(prompt=[[1], [2, 3]]))
    assert req.prompt_inputs() == [PromptInput(token_ids=(1,)), PromptInput(token_ids=(2, 3))]
    with pytest.raises(InvalidRequestError, match="at most 64 prompts") as err:
        parse(CompletionRequest, _completion(prompt=["a"] * 65)).prompt_inputs()
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="prompts x n=16") as err:
        parse(CompletionRequest, _completion(prompt=["a"] * 17, n=16)).prompt_inputs()
    assert err.value.param == "n"


def test_a_prompt_may_come_as_a_batch_of_one_in_either_form():
    def prompt_of(prompt):
        return parse(CompletionRequest, _completion(prompt=prompt)).prompt_input()

    assert prompt_of([[5, 6]]) == prompt_of([5, 6]) == PromptInput(token_ids=(5, 6))
    assert prompt_of(["hi"]) == prompt_of("hi") == PromptInput(text="hi")
    with pytest.raises(InvalidRequestError, match="prompt: must be a string, an array") as err:
        prompt_of([["hi"]])
    assert err.value.param == "prompt"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        # A call must be one (tests/test_openai_tools.py has the rest).
        ({"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}, "tool_calls.0"),
        ({"role": "assistant", "content": "", "function_call": {"name": "f"}}, "function_call"),
        # Only an assistant's content may be null (OpenAI's rule).
        ({"role": "user", "content": None}, "content"),
        ({"role": "system"}, "content"),
    ],
)
def test_a_turn_that_is_not_text_is_refused_naming_its_field(message, param):
    history = [{"role": "user", "content": "q"}, message]
    with pytest.raises(InvalidRequestError) as err:
        parse(ChatCompletionRequest, _chat(messages=history))
    assert err.value.param == f"messages.1.{param}"
    assert str(err.value).startswith(f"messages.1.{param}: ")


def test_an_assistant_turn_may_be_null_and_carry_no_calls():
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [], "function_call": None},
    ]
    req = parse(ChatCompletionRequest, _chat(messages=history))
    assert req.prompt_input() == PromptInput(messages=(("user", "q"), ("assistant", "")))


def test_context_errors_name_the_fields_the_client_sent():
    chat = parse(ChatCompletionRequest, _chat(max_completion_tokens=9))
    prompt_error = InvalidRequestError("too long", param="prompt")
    assert chat.as_sent(prompt_error).param == "messages"
    budget = chat.as_sent(InvalidRequestError("lower max_tokens", param="max_tokens"))
    assert (budget.param, str(budget)) == ("max_completion_tokens", "lower max_completion_tokens")
    legacy = parse(ChatCompletionRequest, _chat(max_tokens=9))
    assert legacy.as_sent(InvalidRequestError("x", param="max_tokens")).param == "max_tokens"
    completion = parse(CompletionRequest, _completion())
    assert completion.as_sent(InvalidRequestError("x", param="prompt")).param == "prompt"


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_a_min_tokens_past_the_room_is_the_contexts_limit_not_an_unsent_max_tokens(model):
    body = _chat(min_tokens=300) if model is ChatCompletionRequest else _completion(min_tokens=300)
    with pytest.raises(InvalidRequestError, match=r"min_tokens \(300\) is more than the 40") as e:
        parse(model, body).sampling_params(room=40)
    assert (e.value.param, e.value.code) == ("min_tokens", "context_length_exceeded")
    assert parse(model, body).sampling_params(room=300).min_tokens == 300


def test_an_error_body_carries_the_field_as_its_param():
    with pytest.raises(InvalidRequestError) as err:
        parse(ChatCompletionRequest, _chat(tools=[{"type": "function"}]))
    body = error_body(str(err.value), "invalid_request_error", err.value.param)
    assert body["error"]["param"] == "tools.0.function"
    assert body["error"]["message"].startswith("tools.0.function: ")


def test_n_choices_are_n_requests_with_their_own_seeds():
    assert parse(CompletionRequest, _completion()).n == 1
    assert parse(ChatCompletionRequest, _chat(n=4)).n == 4
    for bad in (0, 17, True):
        with pytest.raises(InvalidRequestError) as refused:
            parse(CompletionRequest, _completion(n=bad))
        assert refused.value.param == "n"
    unseeded = SamplingParams(temperature=0.7)
    assert choice_params(unseeded, 3, stream=False) == [unseeded] * 3
    seeds = [p.seed for p in choice_params(SamplingParams(seed=2**63 - 1), 3, stream=False)]
    assert seeds == [2**63 - 1, 0, 1]
    # The prompt's logprobs: computed once, by the first choice, unless each choice's
    # first chunk must carry them.
    scored = SamplingParams(prompt_logprobs=2, seed=1)
    once = [p.prompt_logprobs for p in choice_params(scored, 3, stream=False)]
    assert once == [2, None, None]
    assert [p.prompt_logprobs for p in choice_params(scored, 3, stream=True)] == [2, 2, 2]
