"""workers/engine/structured_output.py: the spec a request carries, checked as it is made."""

from __future__ import annotations

import json

import pytest

from workers.engine.structured_output import MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutput
from workers.errors import InvalidRequestError


def test_a_json_schema_is_kept_as_its_text_in_the_given_key_order():
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    assert spec.kind == "json"
    assert list(json.loads(spec.spec)["properties"]) == ["b", "a"]
    assert StructuredOutput.json_schema(spec.spec) == spec  # its JSON text is the same spec
    assert StructuredOutput.json_schema(True).spec == "{}"  # any JSON value


def test_the_field_it_came_from_is_not_part_of_the_spec():
    a = StructuredOutput("regex", "[0-9]+", param="guided_regex")
    b = StructuredOutput("regex", "[0-9]+", param="structured_outputs.regex")
    assert a == b and hash(a) == hash(b)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StructuredOutput.json_schema("{not json", "guided_json"), "not valid JSON"),
        (lambda: StructuredOutput.json_schema([1], "guided_json"), "must be an object"),
        (lambda: StructuredOutput.choice([], "guided_choice"), "non-empty list"),
        (lambda: StructuredOutput.choice(["a", ""], "guided_choice"), "non-empty strings"),
        (lambda: StructuredOutput.choice(["a", 1], "guided_choice"), "non-empty strings"),
        (lambda: StructuredOutput.choice(["x"] * (MAX_CHOICES + 1), "c"), "at most"),
        (lambda: StructuredOutput("regex", "", "guided_regex"), "must not be empty"),
        (lambda: StructuredOutput("lark", "start: x", "g"), "must be one of"),
        (lambda: StructuredOutput("grammar", "x" * (MAX_SPEC_CHARS + 1), "g"), "at most"),
    ],
)
def test_a_bad_spec_is_refused_naming_its_field(make, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        make()
    assert err.value.param is not None and str(err.value).startswith(err.value.param)


def test_every_kind_has_a_grammar():
    for spec in (
        StructuredOutput.json_schema({"type": "integer"}),
        StructuredOutput("json_object"),
        StructuredOutput("regex", "[a-z]+"),
        StructuredOutput.choice(["yes", "no"]),
        StructuredOutput("grammar", 'start: "a"+'),
        StructuredOutput("grammar", 'root ::= "a"+'),  # GBNF
    ):
        assert spec.grammar()
