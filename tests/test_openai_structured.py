"""serve_app/openai/structured.py: OpenAI's response_format, vLLM's structured_outputs and
guided_* fields, as one engine constraint (through `parse` and `sampling_params`, as
bodies arrive); contradictions and bad values are 400s naming the field."""

from __future__ import annotations

import json

import pytest

from serve_app.openai.requests import ChatCompletionRequest, CompletionRequest, parse
from workers.engine import StructuredOutput
from workers.errors import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "a"}], **fields}


def _structured(body, model=ChatCompletionRequest) -> StructuredOutput | None:
    return parse(model, body).sampling_params(room=100).structured


def _refusal(body, model=ChatCompletionRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        _structured(body, model)
    return err.value


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutput.json_schema(SCHEMA),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
            StructuredOutput.json_schema({}),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput.json_schema(SCHEMA)),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            StructuredOutput.json_schema(SCHEMA),
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutput("regex", "[0-9]+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutput.choice(["x", "y"])),
        (
            {"structured_outputs": {"grammar": 'start: "a"'}},
            StructuredOutput("grammar", 'start: "a"'),
        ),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            StructuredOutput("regex", "a"),
        ),
        ({"guided_json": SCHEMA}, StructuredOutput.json_schema(SCHEMA)),
        ({"guided_regex": "a+"}, StructuredOutput("regex", "a+")),
        ({"guided_choice": ["x"]}, StructuredOutput.choice(["x"])),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"')),
        (
            {"guided_regex": "a+", "guided_decoding_backend": "xgrammar"},
            StructuredOutput("regex", "a+"),
        ),
        ({"structured_outputs": None, "response_format": None}, None),
    ],
)
def test_each_spelling_gives_the_engine_one_constraint(fields, expected):
    assert _structured(_chat(**fields)) == expected
    completion = {"model": "m", "prompt": "x", **fields}
    assert _structured(completion, CompletionRequest) == expected


def test_the_constraint_names_the_field_it_came_from():
    spec = _structured(_chat(guided_regex="a"))
    assert spec.param == "guided_regex"
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    assert _structured(_chat(response_format=schema)).param == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "one output constraint",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs.choice",
            "one constraint",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
            "non-empty",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": "yes"},
                }
            },
            "response_format.json_schema.strict",
            "true or false",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": [1]},
                }
            },
            "response_format.json_schema.schema",
            "must be an object",
        ),
        ({"structured_outputs": {"yaml": "a"}}, "structured_outputs.yaml", "unknown"),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "true"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "string"),
        ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
    ],
)
def test_contradictions_and_bad_values_are_refused_naming_the_field(fields, param, message):
    error = _refusal(_chat(**fields))
    assert error.param == param
    assert message in str(error)
