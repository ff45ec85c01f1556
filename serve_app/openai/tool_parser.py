"""A choice's text split, as it streams, into content and the tool calls the model wrote
in the Hermes format (workers/model/tool_calls.py).

Text is released as soon as it cannot be part of a call: a tail that may still open one
(`<tool_c`) is held until the next text says. A block between the tags that is not a
call of an offered function (not JSON, no name, another name) stays text, as written.
Whitespace next to a call is not content: a trailing run is released only once text
follows, so a stream's content deltas add up to the unstreamed content.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from workers.model import CALL_CLOSE, CALL_OPEN

# A parsed call: (function name, arguments as JSON text), as OpenAI's tool_calls hold it.
Call = tuple[str, str]


class ToolCallParser:
    def __init__(self, names: Collection[str]):
        self._names = set(names)
        self._held = ""  # text not yet released: a possible call's start, or an open call
        self._space = ""  # trailing whitespace released only if text follows
        self._after_call = False  # whitespace that follows a call is not content
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """(content to release now, calls completed by `text`)."""
        self._held += text
        content: list[str] = []
        calls: list[Call] = []
        while True:
            start = self._held.find(CALL_OPEN)
            if start < 0:
                keep = _open_prefix(self._held)
                cut = len(self._held) - keep
                content.append(self._text(self._held[:cut]))
                self._held = self._held[cut:]
                break
            content.append(self._text(self._held[:start]))
            end = self._held.find(CALL_CLOSE, start)
            if end < 0:
                self._held = self._held[start:]
                break
            block = self._held[start + len(CALL_OPEN) : end]
            self._held = self._held[end + len(CALL_CLOSE) :]
            call = self._call(block)
            if call is None:
                content.append(self._text(CALL_OPEN + block + CALL_CLOSE))
            else:
                calls.append(call)
                self._space, self._after_call = "", True
        self.num_calls += len(calls)
        return "".join(content), calls

    def finish(self) -> str:
        """The content left at the end (an unclosed block is text, as written)."""
        rest, self._held = self._text(self._held), ""
        rest, self._space = rest + self._space, ""
        return rest

    def _text(self, text: str) -> str:
        """Releases text outside calls, less whitespace next to a call."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        released = self._space + body
        self._space = text[len(body) :]
        return released

    def _call(self, block: str) -> Call | None:
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self._names:
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            return call["name"], arguments
        return call["name"], json.dumps(arguments, ensure_ascii=False)


def _open_prefix(text: str) -> int:
    """Length of the longest tail of `text` that begins CALL_OPEN."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
