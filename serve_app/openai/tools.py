"""Tools on chat completions: OpenAI's `tools` and `tool_choice`, checked, and the
grammar that makes `required` and a named tool choice certain.

The model writes calls in the Hermes format (workers/model/tool_calls.py). With
`tool_choice` "auto" it decides itself and the output is parsed (tool_parser.py); with
"required" or a named function its output is constrained to one or more calls (one
with `parallel_tool_calls` false) whose arguments match the function's schema, so even a
small model's calls parse and validate. "none" offers no tools.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from workers.engine import InvalidRequestError, StructuredOutput
from workers.model import CALL_CLOSE, CALL_OPEN

# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
# Calls are JSON written as the engine writes structured output (structured_output.py).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolChoice:
    """What a request's tools ask of the model: `mode` is "none", "auto" or "required"
    (a named function is "required" with `name`); `parallel`: more than one call."""

    mode: str
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode == "required"


def check_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's tool entries, checked: each a function with a valid, unique name and an
    object schema (or none) as its parameters."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: at most {MAX_TOOLS}, got {len(tools)}", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(
                f"{where}.type: only function tools are supported", param=f"{where}.type"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(
                f"{where}.function: must be an object with the function's name",
                param=f"{where}.function",
            )
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(
                f"{where}.function.name: must be 1-64 letters, digits, _ or -, got "
                f"{json.dumps(name)[:70]}",
                param=f"{where}.function.name",
            )
        if name in names:
            raise InvalidRequestError(
                f"{where}.function.name: {name!r} is offered twice", param=f"{where}.function.name"
            )
        names.add(name)
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise InvalidRequestError(
                f"{where}.function.parameters: must be a JSON schema object",
                param=f"{where}.function.parameters",
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(
                f"{where}.function.description: must be a string",
                param=f"{where}.function.description",
            )
    return tools


def tool_choice(
    choice: str | dict[str, Any] | None, tools: list[dict[str, Any]], parallel: bool | None
) -> ToolChoice:
    """The request's choice, checked against its tools (absent: "auto" with tools, "none"
    without, as OpenAI)."""
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel is not False)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice: must be 'none', 'auto', 'required' or a function, got {choice!r}",
                param="tool_choice",
            )
        if choice != "none" and not tools:
            raise InvalidRequestError(
                f"tool_choice: {choice!r} needs tools; send tools, or leave tool_choice out",
                param="tool_choice",
            )
        return ToolChoice(choice, parallel=parallel is not False)
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError(
            'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise InvalidRequestError(
            f"tool_choice.function.name: {name!r} is not among the tools ({', '.join(names)})",
            param="tool_choice.function.name",
        )
    return ToolChoice("required", name, parallel=parallel is not False)


def call_grammar(tools: list[dict[str, Any]], choice: ToolChoice) -> StructuredOutput:
    """The output constraint of a forced choice: calls in the Hermes format, each naming
    one of the tools (the named one, if any) with arguments valid under its schema."""
    assert choice.forced
    offered = [t["function"] for t in tools if choice.name in (None, t["function"]["name"])]
    definitions: dict[str, Any] = {}
    options = []
    for i, f in enumerate(offered):
        parameters = _rooted(f.get("parameters", {"type": "object"}), f"f{i}_", definitions)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    call_schema = {"anyOf": options, "x-guidance": _JSON_STYLE}
    if definitions:
        call_schema["$defs"] = definitions
    calls = 'call ("\\n" call)*' if choice.parallel else "call"
    lark = (
        f"start: {calls}\n"
        f"call: {json.dumps(CALL_OPEN + chr(10))} arguments {json.dumps(chr(10) + CALL_CLOSE)}\n"
        f"arguments: %json {json.dumps(call_schema)}\n"
    )
    return StructuredOutput("grammar", lark, param="tools")


def _rooted(schema: Any, prefix: str, definitions: dict[str, Any]) -> Any:
    """A function's parameter schema made to stand inside the calls' schema: its own
    definitions (`$defs`, `definitions`) moved to the calls' `$defs` under `prefix`, and
    its references, to them or to its root, pointed there."""
    if not isinstance(schema, dict):
        return schema
    root = f"{prefix}root"

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key in ("$defs", "definitions") and node is schema:
                continue
            if key == "$ref" and isinstance(value, str):
                value = _reference(value, prefix, root)
            out[key] = rewrite(value)
        return out

    for section in ("$defs", "definitions"):
        for name, sub in (schema.get(section) or {}).items():
            definitions[f"{prefix}{name}"] = rewrite(sub)
    rewritten = rewrite(schema)
    if _refers_to_root(schema):
        definitions[root] = rewritten
        return {"$ref": f"#/$defs/{root}"}
    return rewritten


def _reference(ref: str, prefix: str, root: str) -> str:
    for section in ("#/$defs/", "#/definitions/"):
        if ref.startswith(section):
            return f"#/$defs/{prefix}{ref[len(section) :]}"
    return f"#/$defs/{root}" if ref == "#" else ref


def _refers_to_root(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("$ref") == "#" or any(_refers_to_root(v) for v in node.values())
    if isinstance(node, list):
        return any(_refers_to_root(v) for v in node)
    return False
