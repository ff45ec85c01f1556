"""Engine outputs -> OpenAI completion objects and SSE chunks, for one choice or several."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from serve_app.api_keys import Unauthenticated
from serve_app.openai import requests as openai_api
from serve_app.openai.responses import (
    DONE_EVENT,
    Echo,
    ResponseBuilder,
    http_error,
    sse_events,
    unaborted,
    without_completion,
)
from serve_app.streaming.stream_merge import merge_streams
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams, TokenLogprob, check_request
from workers.engine.sequence import FinishReason
from workers.errors import EngineDeadError, InvalidRequestError


def _outputs(rid: str = "r", cached: int = 1) -> list[RequestOutput]:
    lp = TokenLogprob(7, -0.25, ((7, -0.25),))
    return [
        RequestOutput(rid, [7], "Hel", [lp]),
        RequestOutput(rid, [8], "lo", [lp], True, FinishReason.STOP, 4, 2, cached),
    ]


def _body(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event.removeprefix("data: "))


def test_a_completion_object_carries_text_finish_reason_and_usage():
    body = ResponseBuilder(False, "r", "m", lambda t: f"<{t}>", bytes).complete([_outputs()])
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["logprobs"]["tokens"] == ["<7>", "<7>"]
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 3]
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_completion_top_logprobs_always_hold_the_sampled_token():
    # Sampled 7; the one alternative asked for is token 3, more likely.
    lps = [TokenLogprob(7, -1.5, ((3, -0.5),)), TokenLogprob(3, -0.5, ())]
    outs = [RequestOutput("r", [7, 3], "ab", lps, True, FinishReason.LENGTH, 4, 2, 0)]
    body = ResponseBuilder(False, "r", "m", lambda t: f"<{t}>", bytes).complete([outs])
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [
        {"<3>": -0.5, "<7>": -1.5},
        {"<3>": -0.5},
    ]
    # Two tokens of one text (partial UTF-8): the sampled one's logprob is the one shown.
    same_text = ResponseBuilder(False, "r", "m", lambda t: "\ufffd", bytes).complete([outs])
    assert same_text["choices"][0]["logprobs"]["top_logprobs"][0] == {"\ufffd": -1.5}


def _echoed_outputs() -> list[RequestOutput]:
    # Prompt tokens 5, 6 ("ab"), asked with echo and logprobs=1: 6's logprob comes first.
    prompt_lps = [TokenLogprob(6, -2.0, ((9, -0.1),))]
    lp = TokenLogprob(7, -0.25, ((7, -0.25),))
    return [
        RequestOutput("r", [7], "H", [lp], prompt_logprobs=prompt_lps),
        RequestOutput("r", [8], "i", [lp], True, FinishReason.LENGTH, 2, 2, 0),
    ]


def test_an_echoed_completion_starts_with_the_prompt_and_its_logprobs():
    builder = ResponseBuilder(False, "r", "m", lambda t: f"<{t}>", bytes, [Echo("ab", [5, 6], 1)])
    (choice,) = builder.complete([_echoed_outputs()])["choices"]
    assert choice["text"] == "abHi"
    lps = choice["logprobs"]
    assert lps["tokens"] == ["<5>", "<6>", "<7>", "<7>"]
    # The first prompt token has no context, so no logprob (null, as in OpenAI's).
    assert lps["token_logprobs"] == [None, -2.0, -0.25, -0.25]
    assert lps["top_logprobs"][:2] == [None, {"<9>": -0.1, "<6>": -2.0}]
    assert lps["text_offset"] == [0, 3, 6, 9]


def test_an_echoed_stream_sends_the_prompt_once_per_choice_in_its_first_chunk():
    builder = ResponseBuilder(False, "r", "m", lambda t: f"<{t}>", bytes, [Echo("ab", [5, 6], 1)])
    first, second = (_body(builder.chunk(o))["choices"][0] for o in _echoed_outputs())
    assert (first["text"], second["text"]) == ("abH", "i")
    assert first["logprobs"]["token_logprobs"] == [None, -2.0, -0.25]
    assert second["logprobs"]["text_offset"] == [9]
    # Without logprobs asked, the text alone.
    plain = ResponseBuilder(False, "r", "m", str, bytes, [Echo("ab", [5, 6], 1)])
    assert _body(plain.chunk(RequestOutput("r", [7], "H")))["choices"][0]["text"] == "abH"
    assert _body(plain.chunk(RequestOutput("r", [7], "H"), index=1))["choices"][0]["text"] == "abH"


def test_vllm_prompt_logprobs_name_each_prompt_token_its_rank_and_alternatives():
    # Computed with 2 alternatives (prompt_logprobs 2), echoed with logprobs 1.
    prompt_lps = [TokenLogprob(6, -2.0, ((9, -0.1), (4, -1.0)), 3)]
    outs = [
        RequestOutput(
            "r", [7], "H", [], True, FinishReason.LENGTH, 2, 1, prompt_logprobs=prompt_lps
        )
    ]
    builder = ResponseBuilder(
        False, "r", "m", lambda t: f"<{t}>", bytes, [Echo("ab", [5, 6], top_n=1)], 2
    )
    (choice,) = builder.complete([outs])["choices"]

    def entry(logprob, rank, token):
        return {"logprob": logprob, "rank": rank, "decoded_token": token}

    assert choice["prompt_logprobs"] == [
        None,  # the first prompt token: no context, as in vLLM's
        {"6": entry(-2.0, 3, "<6>"), "9": entry(-0.1, 1, "<9>"), "4": entry(-1.0, 2, "<4>")},
    ]
    # The prompt token's own entry first, as vLLM orders them.
    assert list(choice["prompt_logprobs"][1]) == ["6", "9", "4"]
    # The echo shows its own logprobs' one alternative, not the two computed.
    assert choice["logprobs"]["top_logprobs"][1] == {"<9>": -0.1, "<6>": -2.0}
    # Chat: once for the request, beside its choices.
    chat = ResponseBuilder(True, "r", "m", lambda t: f"<{t}>", bytes, prompt_logprobs=0)
    body = chat.complete([outs])
    assert body["prompt_logprobs"] == [None, {"6": entry(-2.0, 3, "<6>")}]
    assert "prompt_logprobs" not in body["choices"][0]
    # Not asked: not there.
    assert "prompt_logprobs" not in ResponseBuilder(True, "r", "m", str, bytes).complete([outs])
    # Echo without logprobs: the prompt's text, and no logprobs object for it, though the
    # engine computed the prompt's logprobs for prompt_logprobs.
    unscored = ResponseBuilder(False, "r", "m", str, bytes, [Echo("ab", [5, 6], None)], 2)
    (choice,) = unscored.complete([outs])["choices"]
    assert choice["text"] == "abH" and choice["logprobs"] is None
    assert len(choice["prompt_logprobs"]) == 2


def test_choices_after_the_first_show_the_first_ones_prompt_logprobs():
    # Unstreamed, only the first choice computes them (openai_api.choice_params).
    prompt_lps = [TokenLogprob(6, -2.0, ((9, -0.1),), 2)]
    first = RequestOutput("a", [7], "H", [], True, FinishReason.LENGTH, 2, 1)
    builder = ResponseBuilder(False, "r", "m", str, bytes, [Echo("ab", [5, 6], 1)], 1)
    body = builder.complete(
        [[replace(first, prompt_logprobs=prompt_lps)], [replace(first, request_id="b")]]
    )
    zero, one = body["choices"]
    assert zero["prompt_logprobs"] == one["prompt_logprobs"] != [None]
    assert zero["logprobs"] == one["logprobs"]


def test_an_echo_of_the_prompt_alone_drops_the_sampled_token():
    async def main():
        async def outputs():
            for out in _echoed_outputs()[:1]:
                yield 0, replace(out, finished=True, finish_reason=FinishReason.STOP)

        return [pair async for pair in without_completion(outputs())]

    ((index, out),) = asyncio.run(main())
    assert (out.new_token_ids, out.new_text, out.new_logprobs) == ([], "", [])
    assert out.num_output_tokens == 0 and out.finish_reason is FinishReason.LENGTH
    builder = ResponseBuilder(False, "r", "m", lambda t: f"<{t}>", bytes, [Echo("ab", [5, 6], 1)])
    body = builder.complete([[out]])
    assert body["choices"][0]["text"] == "ab" and body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [None, -2.0]
    assert body["choices"][0]["finish_reason"] == "length"


def test_n_choices_each_have_their_index_and_count_the_prompt_once():
    short = [RequestOutput("q", [9], "Hi", [], True, FinishReason.LENGTH, 4, 1, 0)]
    builder = ResponseBuilder(True, "r", "m", str, bytes)
    body = builder.complete([_outputs(), short])
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["Hello", "Hi"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 3


def test_chat_logprobs_carry_each_tokens_exact_bytes_not_its_replacement_character():
    # Token 7 holds the first two bytes of "👩": its text alone is U+FFFD.
    builder = ResponseBuilder(True, "r", "m", lambda t: "\ufffd", lambda t: b"\xf0\x9f")
    content = builder.complete([_outputs()])["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "\ufffd" and content[0]["bytes"] == [0xF0, 0x9F]
    assert content[0]["top_logprobs"][0]["bytes"] == [0xF0, 0x9F]


def test_completion_chunks_carry_text_offsets_that_run_on_per_choice():
    builder = ResponseBuilder(False, "r", "m", lambda t: f"<{t}>", bytes)
    first, last = _outputs()
    events = [builder.chunk(first, 0), builder.chunk(first, 1), builder.chunk(last, 0)]
    choices = [_body(e)["choices"][0] for e in events]
    assert [c["index"] for c in choices] == [0, 1, 0]
    assert [c["logprobs"]["text_offset"] for c in choices] == [[0], [0], [3]]


def test_each_chat_choice_opens_with_the_role_and_ends_with_its_finish_reason():
    builder = ResponseBuilder(True, "r", "m", str, bytes)
    first, last = _outputs()
    events = [builder.chunk(first, 0), builder.chunk(first, 1), builder.chunk(last, 0)]
    bodies = [_body(e) for e in [*events, builder.usage_chunk([last, last])]]
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert bodies[1]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert bodies[2]["choices"][0]["delta"] == {"content": "lo"}
    assert bodies[2]["choices"][0]["finish_reason"] == "stop"
    assert bodies[3]["choices"] == [] and bodies[3]["usage"]["completion_tokens"] == 4
    assert {b["object"] for b in bodies} == {"chat.completion.chunk"}


def test_an_error_mid_stream_is_an_openai_error_event_then_done():
    async def rest():
        yield RequestOutput("r", [8], "lo")
        raise InvalidRequestError("stop_token_ids: 99999 is not a token id")

    async def events():
        builder = ResponseBuilder(False, "r", "m", str, bytes)
        first = RequestOutput("r", [7], "Hel")
        return [e async for e in sse_events(builder, (0, first), merge_streams([rest()]), True)]

    sent = asyncio.run(events())
    assert len(sent) == 4 and sent[-1] == DONE_EVENT
    error = json.loads(sent[2].removeprefix("data: "))["error"]
    assert error["type"] == "invalid_request_error" and "stop_token_ids" in error["message"]


def test_with_include_usage_every_chunk_before_the_usage_chunk_says_usage_null():
    first, last = _outputs()

    async def rest():
        yield last

    async def bodies(include_usage: bool) -> list[dict]:
        builder = ResponseBuilder(True, "r", "m", str, bytes)
        events = sse_events(builder, (0, first), merge_streams([rest()]), include_usage)
        return [_body(e) async for e in events if e != DONE_EVENT]

    with_usage = asyncio.run(bodies(True))
    assert [b["usage"] for b in with_usage[:-1]] == [None, None]
    assert with_usage[-1]["usage"]["total_tokens"] == 6
    assert all("usage" not in b for b in asyncio.run(bodies(False)))


def test_a_choice_the_server_aborted_fails_the_request_instead_of_ending_it():
    cut = RequestOutput("r", [], "", finished=True, finish_reason=FinishReason.ABORT)
    closed = []

    async def outputs():
        try:
            yield 0, _outputs()[0]
            yield 1, cut
            yield 0, _outputs()[1]
        finally:
            closed.append(True)

    async def read():
        return [pair async for pair in unaborted(outputs())]

    with pytest.raises(EngineDeadError, match="retry it") as err:
        asyncio.run(read())
    assert closed == [True]  # the other choices' streams are closed at once
    response = http_error(err.value)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert json.loads(response.body)["error"]["type"] == "service_unavailable_error"


def test_an_http_error_names_the_field_at_fault_as_its_param():
    with pytest.raises(InvalidRequestError) as refused:
        body = {"model": "m", "prompt": "x", "max_tokens": 0}
        openai_api.parse(openai_api.CompletionRequest, body)
    response = http_error(refused.value)
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and error["param"] == "max_tokens"
    assert error["type"] == "invalid_request_error" and "max_tokens" in error["message"]


def test_a_prompt_past_the_context_carries_openais_code_for_it():
    # Clients trim a conversation and retry on this code.
    with pytest.raises(InvalidRequestError) as refused:
        check_request([1] * 40, SamplingParams(max_tokens=1), 100, 32)
    error = json.loads(http_error(refused.value).body)["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert "maximum context length is 32 tokens" in error["message"]
    assert json.loads(http_error(InvalidRequestError("x")).body)["error"]["code"] is None


def test_a_missing_key_is_a_401_that_asks_for_a_bearer_token():
    response = http_error(Unauthenticated("missing API key"))
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    error = json.loads(response.body)["error"]
    assert (error["message"], error["code"]) == ("missing API key", "invalid_api_key")
    assert "WWW-Authenticate" not in http_error(InvalidRequestError("x")).headers


def test_a_cancellation_by_the_service_is_a_503_and_a_bug_is_openais_server_error():
    cancelled = http_error(asyncio.CancelledError())
    assert cancelled.status_code == 503
    assert json.loads(cancelled.body)["error"]["type"] == "service_unavailable_error"
    bug = http_error(KeyError("x"))
    assert bug.status_code == 500
    error = json.loads(bug.body)["error"]
    assert error["type"] == "server_error" and "KeyError" in error["message"]


def test_a_batch_of_prompts_counts_each_prompt_once_and_echoes_its_own():
    def out(rid, prompt_tokens, text):
        return RequestOutput(rid, [7], text, [], True, FinishReason.LENGTH, prompt_tokens, 1)

    echoes = [Echo("A", [1], None), Echo("BB", [2, 3], None)]
    builder = ResponseBuilder(False, "r", "m", str, bytes, echoes, choices_per_prompt=2)
    done = builder.complete(
        [[out("a0", 1, "x")], [out("a1", 1, "y")], [out("b0", 2, "z")], [out("b1", 2, "w")]]
    )
    assert [c["text"] for c in done["choices"]] == ["Ax", "Ay", "BBz", "BBw"]
    assert [c["index"] for c in done["choices"]] == [0, 1, 2, 3]
    assert done["usage"]["prompt_tokens"] == 3 and done["usage"]["completion_tokens"] == 4
