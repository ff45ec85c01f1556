"""OpenAI request bodies -> engine types, and engine outputs -> completion objects."""

from __future__ import annotations

import json

import pytest

from serve_app.openai_api import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    parse,
)
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import TokenLogprob
from workers.engine.sequence import FinishReason


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


def test_chat_defaults_to_the_room_the_context_leaves():
    req = parse(
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
    )
    assert req.prompt_input().messages == (("user", "a"),)
    assert req.sampling_params(room=77).max_tokens == 77
    req = parse(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "a"}],
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    params = req.sampling_params(room=77)
    assert (params.max_tokens, params.logprobs) == (9, 2)


@pytest.mark.parametrize(
    ("model", "body", "named"),
    [
        (CompletionRequest, {"prompt": "x"}, "model"),
        (CompletionRequest, {"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "robot"}]}, "messages.0.role"),
    ],
)
def test_schema_errors_name_the_field(model, body, named):
    with pytest.raises(ValueError, match=named):
        parse(model, body)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"n": 2}, "n must be 1"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"echo": True}, "echo"),
        ({"prompt": ["a", "b"]}, "one prompt"),
    ],
)
def test_unsupported_settings_are_refused_not_ignored(body, named):
    req = parse(CompletionRequest, {"model": "m", "prompt": "x", **body})
    with pytest.raises(ValueError, match=named):
        req.prompt_input()


def _outputs() -> list[RequestOutput]:
    lp = TokenLogprob(7, -0.25, ((7, -0.25),))
    return [
        RequestOutput("r", [7], "Hel", [lp]),
        RequestOutput("r", [8], "lo", [lp], True, FinishReason.STOP, 4, 2, 1),
    ]


def test_a_completion_object_carries_text_finish_reason_and_usage():
    body = ResponseBuilder(False, "r", "m", lambda t: f"<{t}>", bytes).complete(_outputs())
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["logprobs"]["tokens"] == ["<7>", "<7>"]
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_chat_logprobs_carry_each_tokens_exact_bytes_not_its_replacement_character():
    # Token 7 holds the first two bytes of "👩": its text alone is U+FFFD.
    builder = ResponseBuilder(True, "r", "m", lambda t: "\ufffd", lambda t: b"\xf0\x9f")
    content = builder.complete(_outputs())["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "\ufffd" and content[0]["bytes"] == [0xF0, 0x9F]
    assert content[0]["top_logprobs"][0]["bytes"] == [0xF0, 0x9F]


def test_chat_chunks_open_with_the_role_and_end_with_the_finish_reason():
    builder = ResponseBuilder(True, "r", "m", str, bytes)
    first, last = _outputs()
    events = [builder.chunk(first, first=True), builder.chunk(last), builder.usage_chunk(last)]
    bodies = [json.loads(e.removeprefix("data: ")) for e in events]
    assert all(e.endswith("\n\n") for e in events)
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert bodies[1]["choices"][0]["delta"] == {"content": "lo"}
    assert bodies[1]["choices"][0]["finish_reason"] == "stop"
    assert bodies[2]["choices"] == [] and bodies[2]["usage"]["completion_tokens"] == 2
    assert {b["object"] for b in bodies} == {"chat.completion.chunk"}
