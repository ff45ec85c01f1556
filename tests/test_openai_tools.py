"""serve_app/openai/tools.py with requests.py and responses.py: tools and tool_choice
checked as bodies arrive, the grammar of a forced choice, and calls in the response,
whole or streamed."""

from __future__ import annotations

import json

import pytest
from tiny_model import make_tiny_model

from serve_app.openai.requests import ChatCompletionRequest, parse
from serve_app.openai.responses import ResponseBuilder
from workers.engine import GrammarCompiler, RequestOutput
from workers.engine.sequence import FinishReason
from workers.errors import InvalidRequestError
from workers.model.tokenizer import Tokenizer
from workers.model.tool_calls import call_text

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def _chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}


def _refusal(body) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        parse(ChatCompletionRequest, body).sampling_params(room=100)
    return err.value


@pytest.fixture(scope="module")
def compiler(tmp_path_factory) -> GrammarCompiler:
    tokenizer = Tokenizer(make_tiny_model(tmp_path_factory.mktemp("tiny")))
    compiler = GrammarCompiler(tokenizer.hf, 320, {0})
    compiler.tokenizer = tokenizer
    return compiler


def _accepts(compiler, spec, text: str) -> bool:
    matcher = compiler.matcher(spec)
    ids = compiler.tokenizer.hf.encode(text, add_special_tokens=False).ids
    # Complete: nothing more is allowed, or the end of sequence (token 0) is.
    return all(matcher.accept(t) for t in ids) and (matcher.done or matcher.accept(0))


@pytest.mark.parametrize(
    ("choice", "mode", "name"),
    [
        (None, "auto", None),
        ("auto", "auto", None),
        ("none", "none", None),
        ("required", "required", None),
        ({"type": "function", "function": {"name": "add"}}, "required", "add"),
    ],
)
def test_tool_choice_is_read_against_the_tools(choice, mode, name):
    req = parse(ChatCompletionRequest, _chat(tools=[WEATHER, ADD], tool_choice=choice))
    assert (req.tool_use.mode, req.tool_use.name) == (mode, name)
    params = req.sampling_params(room=100)
    assert (params.structured is not None) == (mode == "required")
    offered = req.prompt_input().tools
    assert offered == (() if mode == "none" else (WEATHER, ADD))
    assert parse(ChatCompletionRequest, _chat()).tool_use.mode == "none"


def test_a_forced_choice_constrains_the_output_to_valid_calls(compiler):
    both = parse(ChatCompletionRequest, _chat(tools=[WEATHER, ADD], tool_choice="required"))
    spec = both.sampling_params(room=100).structured
    good = call_text("get_weather", {"city": "Paris", "days": 2})
    assert _accepts(compiler, spec, good)
    assert _accepts(compiler, spec, good + "\n" + call_text("add", {"a": 1}))
    assert not _accepts(compiler, spec, call_text("get_weather", {"days": 2}))  # city missing
    assert not _accepts(compiler, spec, call_text("get_weather", {"city": 3}))
    assert not _accepts(compiler, spec, call_text("other", {}))
    assert not _accepts(compiler, spec, "Sure: " + good)
    named = {"type": "function", "function": {"name": "add"}}
    one = _chat(tools=[WEATHER, ADD], tool_choice=named, parallel_tool_calls=False)
    spec = parse(ChatCompletionRequest, one).sampling_params(room=100).structured
    assert _accepts(compiler, spec, call_text("add", {"x": [1, 2]}))
    assert not _accepts(compiler, spec, good)
    assert not _accepts(compiler, spec, call_text("add", {}) + "\n" + call_text("add", {}))


def test_a_tools_own_definitions_and_references_hold_inside_the_calls_schema(compiler):
    # What pydantic writes for nested models, and a recursive schema.
    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ship = {
        "type": "function",
        "function": {
            "name": "ship",
            "parameters": {
                "$defs": {"Address": address},
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Address"}},
                "required": ["to"],
            },
        },
    }
    tree = {
        "type": "function",
        "function": {
            "name": "tree",
            "parameters": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
                "required": ["kids"],
            },
        },
    }
    body = _chat(tools=[ship, tree], tool_choice="required")
    spec = parse(ChatCompletionRequest, body).sampling_params(room=100).structured
    assert _accepts(compiler, spec, call_text("ship", {"to": {"city": "Oslo"}}))
    assert not _accepts(compiler, spec, call_text("ship", {"to": {"town": "Oslo"}}))
    assert _accepts(compiler, spec, call_text("tree", {"kids": [{"kids": []}]}))
    assert not _accepts(compiler, spec, call_text("tree", {"kids": [{}]}))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [ADD, ADD]}, "tools.1.function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools.0.function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [ADD], "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {"messages": [{"role": "user", "content": "a", "tool_calls": [{"function": {}}]}]},
            "messages.0.tool_calls",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages.0.tool_calls.0",
        ),
        ({"messages": [{"role": "tool", "tool_call_id": "c"}]}, "messages.0.content"),
    ],
)
def test_bad_tools_and_contradictions_are_refused_naming_the_field(fields, param):
    error = _refusal(_chat(**fields))
    assert error.param == param and param in str(error)


def test_a_history_with_calls_and_their_results_is_a_prompt():
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    call = {"id": "c1", "type": "function", "function": function}
    body = _chat(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    )
    prompt = parse(ChatCompletionRequest, body).prompt_input()
    assert prompt.chat()[1]["tool_calls"] == [call]
    assert prompt.chat()[2] == {"role": "tool", "content": "sunny"}


def _builder() -> ResponseBuilder:
    return ResponseBuilder(True, "r", "m", str, lambda t: b"x", tool_names=["get_weather"])


def _output(text: str, finished: bool) -> RequestOutput:
    return RequestOutput(
        "r", [1] * len(text), text, finished=finished,
        finish_reason=FinishReason.STOP if finished else None,
        num_prompt_tokens=3, num_output_tokens=len(text),
    )  # fmt: skip


def test_calls_in_the_output_are_tool_calls_whole_and_streamed_alike():
    text = "Checking.\n" + call_text("get_weather", {"city": "Rome"}) + "\n"
    done = _builder().complete([[_output(text, True)]])
    (choice,) = done["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}

    builder = _builder()
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    events = [
        json.loads(builder.chunk(_output(p, i == len(pieces) - 1), 0)[len("data: ") :])
        for i, p in enumerate(pieces)
    ]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]) for c in streamed] == [(0, call["function"])]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

    plain = _builder().complete([[_output("No calls here.", True)]])["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "No calls here."}
    assert plain["finish_reason"] == "stop"
