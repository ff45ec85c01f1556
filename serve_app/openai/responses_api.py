"""OpenAI's Responses API (`POST /v1/responses`): text, structured output and tools.

A request is read as the chat completion it amounts to (`ResponsesRequest.chat_request`):
`instructions` become the system message; input items (messages, earlier
`function_call`s and their `function_call_output`s) the history; flat function tools
OpenAI's chat shape; `text.format` the response_format. The engine's outputs then become
a response object's output items (`ResponsesBuilder`), or, streamed, the events OpenAI
sends: response.created and .in_progress, then per item output_item.added, its text or
arguments as deltas and their done events, output_item.done, and response.completed (or
response.incomplete at max_output_tokens). Nothing is stored: `previous_response_id`
is refused, `store` does nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field

from serve_app.errors import public_error
from serve_app.openai.requests import Body, ChatCompletionRequest, parse
from serve_app.openai.responses import HTTP_ERROR_TYPE
from serve_app.openai.tool_parser import Call, ToolCallParser
from workers.engine import FinishReason, InvalidRequestError, RequestOutput

# A chat request's field -> the Responses request's, for error messages.
_RENAMED = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


class ResponsesRequest(Body):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this request amounts to; InvalidRequestError naming the
        Responses field at fault."""
        if self.previous_response_id is not None:
            raise InvalidRequestError(
                "previous_response_id: responses are not stored; send the whole "
                "conversation as input",
                param="previous_response_id",
            )
        if self.reasoning and self.reasoning.get("effort") is not None:
            raise InvalidRequestError(
                "reasoning: this model does not reason; leave it out", param="reasoning"
            )
        body: dict[str, Any] = {
            "model": self.model,
            "messages": _messages(self.instructions, self.input),
            "tools": [_chat_tool(t, i) for i, t in enumerate(self.tools)],
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.text is not None and self.text.get("format") is not None:
            body["response_format"] = _response_format(self.text["format"])
        try:
            return parse(ChatCompletionRequest, body)
        except InvalidRequestError as e:
            raise renamed(e) from None


def renamed(error: InvalidRequestError) -> InvalidRequestError:
    """A chat request's error as the Responses request names its field."""
    if error.param:
        head, _, rest = error.param.partition(".")
        if head in _RENAMED:
            new = _RENAMED[head] + (f".{rest}" if rest else "")
            error.args = (str(error).replace(error.param, new, 1),)
            error.param = new
    return error


def _messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict]:
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item, i)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output)
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
            )
        else:
            raise InvalidRequestError(
                f"input.{i}.type: must be message, function_call or function_call_output, "
                f"got {json.dumps(kind)[:40]}",
                param=f"input.{i}.type",
            )
    return messages


def _text(item: dict[str, Any], index: int) -> Any:
    """A message item's content as chat content: text parts' text joined."""
    content = item.get("content")
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            raise InvalidRequestError(
                f"input.{index}.content.{j}: only input_text and output_text parts are supported",
                param=f"input.{index}.content.{j}",
            )
        parts.append({"type": "text", "text": part.get("text")})
    return parts


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidRequestError(
            f"tools.{index}.type: only function tools are supported", param=f"tools.{index}.type"
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("type") != "json_schema":
        return spec
    schema = {k: spec[k] for k in ("name", "schema", "strict", "description") if k in spec}
    return {"type": "json_schema", "json_schema": schema}


class ResponsesBuilder:
    """Builds one request's response object, or its stream of events."""

    def __init__(self, req: ResponsesRequest, chat: ChatCompletionRequest, model: str):
        self.req = req
        self.model = model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        offered = chat.offered_tools()
        self._parser = ToolCallParser([t["function"]["name"] for t in offered]) if offered else None
        self._sequence = 0
        self._items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item, if any

    # -- the response object --------------------------------------------------------

    def _response(self, status: str, outputs: list[RequestOutput] | None = None) -> dict:
        last = outputs[-1] if outputs else None
        incomplete = last is not None and last.finish_reason is FinishReason.LENGTH
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.req.instructions,
            "max_output_tokens": self.req.max_output_tokens,
            "model": self.model,
            "output": list(self._items),
            "parallel_tool_calls": self.req.parallel_tool_calls is not False,
            "temperature": self.req.temperature,
            "tool_choice": self.req.tool_choice or ("auto" if self.req.tools else "none"),
            "tools": self.req.tools,
            "top_p": self.req.top_p,
            "text": self.req.text or {"format": {"type": "text"}},
            "store": False,
            "metadata": {},
            "usage": None,
        }
        if last is not None and last.finished:
            body["usage"] = {
                "input_tokens": last.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
                "output_tokens": last.num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
            }
        return body

    def complete(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        self._add("".join(o.new_text for o in outputs), final=True)
        self._close()
        return self._response(self._status(outputs[-1]), outputs)

    @staticmethod
    def _status(last: RequestOutput) -> str:
        return "incomplete" if last.finish_reason is FinishReason.LENGTH else "completed"

    # -- items as text arrives (each step yields its stream events) ----------------

    def _add(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Adds text to the output; returns the events it makes."""
        events: list[dict[str, Any]] = []
        if self._parser is None:
            content, calls = text, []
        else:
            content, calls = self._parser.feed(text)
            if final:
                content += self._parser.finish()
        if content:
            events += self._text(content)
        for call in calls:
            events += self._call(call)
        return events

    def _text(self, delta: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._message = {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self._items.append(self._message)
            events.append(self._item_event("response.output_item.added", self._message))
            part = {"type": "output_text", "text": "", "annotations": []}
            self._message["content"].append(part)
            events.append(self._part_event("response.content_part.added", part))
        self._message["content"][0]["text"] += delta
        events.append(self._part_event("response.output_text.delta", None, delta=delta))
        return events

    def _call(self, call: Call) -> list[dict[str, Any]]:
        name, arguments = call
        item = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": f"call_{uuid.uuid4().hex[:24]}",
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self._items.append(item)
        index = len(self._items) - 1
        events = [self._item_event("response.output_item.added", dict(item))]
        item["arguments"] = arguments
        common = {"item_id": item["id"], "output_index": index}
        events.append(
            {"type": "response.function_call_arguments.delta", **common, "delta": arguments}
        )
        events.append(
            {"type": "response.function_call_arguments.done", **common, "arguments": arguments}
        )
        item["status"] = "completed"
        events.append(self._item_event("response.output_item.done", item))
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The open message item's done events."""
        if self._message is None:
            return []
        part = self._message["content"][0]
        self._message["status"] = "completed"
        events = [
            self._part_event("response.output_text.done", None, text=part["text"]),
            self._part_event("response.content_part.done", part),
            self._item_event("response.output_item.done", self._message),
        ]
        self._message = None
        return events

    def _item_event(self, kind: str, item: dict[str, Any]) -> dict[str, Any]:
        return {"type": kind, "output_index": self._items.index(item), "item": item}

    def _part_event(self, kind: str, part: dict[str, Any] | None, **fields) -> dict[str, Any]:
        message = self._message
        body = {
            "type": kind,
            "item_id": message["id"],
            "output_index": self._items.index(message),
            "content_index": 0,
            **fields,
        }
        if part is not None:
            body["part"] = part
        return body

    def _sse(self, event: dict[str, Any]) -> str:
        event = {**event, "sequence_number": self._sequence}
        self._sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    async def events(
        self, first: RequestOutput, rest: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[str]:
        """The stream's SSE events; an error mid-stream is an error event."""
        yield self._sse({"type": "response.created", "response": self._response("in_progress")})
        yield self._sse({"type": "response.in_progress", "response": self._response("in_progress")})
        outputs = [first]
        for event in self._add(first.new_text, final=first.finished):
            yield self._sse(event)
        try:
            async for _, out in rest:
                outputs.append(out)
                for event in self._add(out.new_text, final=out.finished):
                    yield self._sse(event)
        except Exception as e:  # mid-stream: the status line is sent, so an error event
            kind, message = public_error(e)
            yield self._sse(
                {
                    "type": "error",
                    "code": HTTP_ERROR_TYPE.get(kind, kind),
                    "message": message,
                    "param": None,
                }
            )
            return
        for event in self._close():
            yield self._sse(event)
        status = self._status(outputs[-1])
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self._sse({"type": kind, "response": self._response(status, outputs)})
