"""serve_app/openai/responses_api.py: a Responses request as the chat completion it
amounts to, and the engine's outputs as a response object or its stream of events."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_app.openai.requests import parse
from serve_app.openai.responses_api import ResponsesBuilder, ResponsesRequest, renamed
from workers.engine import RequestOutput, StructuredOutput
from workers.engine.sequence import FinishReason
from workers.errors import InvalidRequestError
from workers.model.tool_calls import call_text

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def _request(**fields) -> ResponsesRequest:
    return parse(ResponsesRequest, {"model": "m", "input": "Hi", **fields})


def test_input_items_instructions_and_tools_become_a_chat():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    req = _request(input=items, instructions="Be brief.", tools=[WEATHER], max_output_tokens=9)
    chat = req.chat_request()
    turns = chat.prompt_input().chat()
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool"]
    assert turns[1]["content"] == "Weather in Rome?"
    assert turns[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}
    assert chat.offered_tools()[0]["function"]["name"] == "get_weather"
    assert chat.sampling_params(room=100).max_tokens == 9


def test_text_format_and_a_named_tool_choice_constrain_the_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    params = _request(text=fmt).chat_request().sampling_params(room=100)
    assert params.structured == StructuredOutput.json_schema(schema)
    named = {"type": "function", "name": "get_weather"}
    params = _request(tools=[WEATHER], tool_choice=named).chat_request().sampling_params(100)
    assert params.structured.kind == "grammar"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "image", "url": "x"}]}, "input.0.type"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        (
            {"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
            "tool_choice.function.name",
        ),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_responses_field(fields, param):
    # As the router reads them: the chat's own checks' errors renamed.
    with pytest.raises(InvalidRequestError) as err:
        try:
            _request(**fields).chat_request().sampling_params(room=100)
        except InvalidRequestError as e:
            raise renamed(e) from None
    assert err.value.param == param and str(err.value).startswith(param)


def _out(text: str, finished=True, reason=FinishReason.STOP) -> RequestOutput:
    return RequestOutput(
        "r", [1] * len(text), text, finished=finished,
        finish_reason=reason if finished else None, num_prompt_tokens=4,
        num_output_tokens=len(text),
    )  # fmt: skip


def _builder(**fields) -> ResponsesBuilder:
    req = _request(**fields)
    return ResponsesBuilder(req, req.chat_request(), "m")


def test_a_response_holds_a_message_and_its_function_calls():
    text = "Let me look.\n" + call_text("get_weather", {"city": "Rome"})
    done = _builder(tools=[WEATHER]).complete([_out(text)])
    assert done["object"] == "response" and done["status"] == "completed"
    message, call = done["output"]
    assert message["content"][0] == {
        "type": "output_text",
        "text": "Let me look.",
        "annotations": [],
    }
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Rome"} and call["call_id"].startswith("call_")
    assert done["usage"]["input_tokens"] == 4 and done["usage"]["output_tokens"] == len(text)
    cut = _builder().complete([_out("abc", reason=FinishReason.LENGTH)])
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_the_stream_sends_openais_events_in_order():
    text = "Hi there.\n" + call_text("get_weather", {"city": "Oslo"})
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    outs = [_out(p, finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]

    async def rest():
        for out in outs[1:]:
            yield 0, out

    async def collect():
        return [e async for e in _builder(tools=[WEATHER]).events(outs[0], rest())]

    events = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(collect())]
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "Hi there."
    assert "response.function_call_arguments.done" in kinds
    final = events[-1]
    assert final["type"] == "response.completed"
    assert [i["type"] for i in final["response"]["output"]] == ["message", "function_call"]
