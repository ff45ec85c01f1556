"""Structured output as OpenAI-compatible clients ask for it, as one engine constraint.

Three spellings reach the same `StructuredOutput`: OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's `structured_outputs` object (`json`, `regex`,
`choice`, `grammar`, `json_object`) and vLLM's older `guided_*` fields. A request sets
at most one constraint; two are contradictory, and refused naming both.
"""

from __future__ import annotations

from typing import Any

from workers.engine import InvalidRequestError, StructuredOutput

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
# structured_outputs options that ask for nothing beyond what is done anyway: the JSON
# is generated without free whitespace, and no other engine is fallen back to.
_NEUTRAL_OPTIONS = ("disable_any_whitespace", "disable_fallback")
# The rest are refused when set, naming what to do instead.
_REFUSED_OPTIONS = {
    "disable_additional_properties": "set additionalProperties: false in the schema",
    "whitespace_pattern": "JSON is generated without free whitespace",
    "structural_tag": "structural tags are not supported; use tools or a grammar",
}
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_output(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> StructuredOutput | None:
    """The request's one output constraint, or None; `guided`: the guided_* fields set."""
    found: list[StructuredOutput] = []
    if response_format is not None:
        found += _response_format(response_format)
    if structured_outputs is not None:
        found += _structured_outputs(structured_outputs)
    for name in _GUIDED:
        if guided.get(name) is not None:
            found.append(_constraint(name.removeprefix("guided_"), guided[name], name))
    if len(found) > 1:
        first, second = found[0].param, found[1].param
        raise InvalidRequestError(
            f"{first} and {second}: a request takes one output constraint; send one of them",
            param=second,
        )
    return found[0] if found else None


def _response_format(value: dict[str, Any]) -> list[StructuredOutput]:
    kind = value.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [StructuredOutput("json_object", param="response_format")]
    if kind != "json_schema":
        raise InvalidRequestError(
            "response_format.type: must be 'text', 'json_object' or 'json_schema', "
            f"got {_quoted(kind)}",
            param="response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError(
            "response_format.json_schema: must be an object with the schema's name and "
            "its schema ({'name': ..., 'schema': {...}})",
            param="response_format.json_schema",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            "response_format.json_schema.name: must be a non-empty string",
            param="response_format.json_schema.name",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(
            "response_format.json_schema.strict: must be true or false",
            param="response_format.json_schema.strict",
        )
    # OpenAI's "schema" is optional: without it, any JSON value. Strict or not, the
    # output follows the schema: it is enforced token by token.
    schema = spec.get("schema", True)
    return [StructuredOutput.json_schema(schema, "response_format.json_schema.schema")]


def _structured_outputs(value: dict[str, Any]) -> list[StructuredOutput]:
    found = []
    for key, given in value.items():
        where = f"structured_outputs.{key}"
        if given is None:
            continue
        if key in _CONSTRAINTS:
            found.append(_constraint(key, given, where))
        elif key in _NEUTRAL_OPTIONS:
            if not isinstance(given, bool):
                raise InvalidRequestError(f"{where}: must be true or false", param=where)
        elif key in _REFUSED_OPTIONS:
            raise InvalidRequestError(
                f"{where}: not supported; {_REFUSED_OPTIONS[key]}", param=where
            )
        else:
            raise InvalidRequestError(
                f"{where}: unknown; the constraints are {', '.join(_CONSTRAINTS)}", param=where
            )
    if len(found) > 1:
        raise InvalidRequestError(
            f"{found[1].param}: structured_outputs takes one constraint, got "
            f"{' and '.join(f.param.rsplit('.', 1)[-1] for f in found)}",
            param=found[1].param,
        )
    return found


def _constraint(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput.json_schema(value, param)
    if kind == "choice":
        return StructuredOutput.choice(value, param)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(f"{param}: must be true when set", param=param)
        return StructuredOutput("json_object", param=param)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param}: must be a string", param=param)
    return StructuredOutput(kind, value, param)


def _quoted(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
