"""Tool calls as text: the Hermes format (SmolLM2, Qwen and most open chat models).

A call is a JSON object with the function's name and arguments between `<tool_call>`
tags; the model writes one block per call. A chat template that knows tools renders them
itself (`Tokenizer.apply_chat_template` passes them on). For one that does not,
`inline_tools` rewrites the conversation into messages such a template renders: the tool
list in the system message, earlier calls as tagged text in the assistant's turn, and
their results as a user turn between `<tool_response>` tags.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it; `arguments`: an object, or its JSON text."""
    if isinstance(arguments, str):
        arguments = parse_arguments(arguments)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def parse_arguments(text: str) -> Any:
    """A call's arguments as sent in a history (OpenAI's are JSON text); text that is not
    JSON is kept as the string it is."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def calls_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    return list(message.get("tool_calls") or [])


def tools_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system message's part that offers `tools` (OpenAI's {"type": "function",
    "function": {...}} entries) and says how to call them."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help answer. These are their signatures, one JSON "
        f"object per line:\n<tools>\n{listed}\n</tools>\n\n"
        "To call one, answer with a JSON object holding its name and arguments between "
        f"tags, one block per call:\n{CALL_OPEN}\n"
        '{"name": "<function name>", "arguments": {<its arguments>}}\n'
        f"{CALL_CLOSE}"
    )


def inline_tools(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[dict[str, str]]:
    """`messages` (OpenAI's shape: tool_calls on assistant turns, role "tool" for their
    results) as plain role/content messages, with `tools` offered in the system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls_of(m)
            ]
            content = "\n".join(([content] if content else []) + calls)
        if m["role"] == "tool":
            result = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("tool_results"):
                # Results in a row are one user turn: templates that insist on turns
                # alternating between user and assistant take them.
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
            continue
        out.append({"role": m["role"], "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        offer = tools_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{offer}"}
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out
