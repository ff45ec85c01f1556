"""serve_app/openai/tool_parser.py: text into content and calls, the same streamed in any
pieces as whole."""

from __future__ import annotations

import pytest

from serve_app.openai.tool_parser import ToolCallParser


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _whole(text: str, names=("get_weather", "add")) -> tuple[str, list]:
    parser = ToolCallParser(names)
    content, calls = parser.feed(text)
    return content + parser.finish(), calls


def _streamed(text: str, size: int, names=("get_weather", "add")) -> tuple[str, list]:
    parser = ToolCallParser(names)
    content, calls = [], []
    for i in range(0, len(text), size):
        c, found = parser.feed(text[i : i + size])
        content.append(c)
        calls += found
    content.append(parser.finish())
    return "".join(content), calls


TEXTS = [
    "Just an answer, no calls.",
    _call("get_weather", '{"city": "Paris"}'),
    "Let me check.\n" + _call("get_weather", '{"city": "Paris"}') + "\n"
    + _call("add", '{"a": 1, "b": 2}') + "\n",
    _call("add", '"{\\"a\\": 1}"'),  # arguments as JSON text, as OpenAI's
    "<tool_call>\nnot json\n</tool_call> and then text",
    _call("unknown", "{}") + " stays text",
    "Unclosed: <tool_call>\n{\"name\": \"add\"",
    "a <tool_c is not a tag, nor is <tool_call",
    "  leading and trailing space stay without calls  ",
]  # fmt: skip


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_in_any_pieces_it_parses_as_whole(text, size):
    assert _streamed(text, size) == _whole(text)


def test_calls_become_name_and_arguments_and_whitespace_beside_them_is_not_content():
    content, calls = _whole(TEXTS[2])
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]
    assert _whole(TEXTS[1]) == ("", [("get_weather", '{"city": "Paris"}')])
    assert _whole(TEXTS[3]) == ("", [("add", '{"a": 1}')])


def test_what_is_not_a_call_of_an_offered_function_stays_text_as_written():
    for text in TEXTS[4:8]:
        assert _whole(text) == (text, [])
    assert _whole(TEXTS[8]) == (TEXTS[8], [])
