"""The OpenAI-compatible HTTP surface's responses: engine outputs -> completion objects and
SSE chunks (the requests are `requests.py`). A request's choice i is engine request i."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.errors import public_error, root_cause
from serve_app.openai.tool_parser import ToolCallParser
from workers.engine import (
    EngineDeadError,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    TokenLogprob,
)

DONE_EVENT = "data: [DONE]\n\n"
# errors.public_error's kinds, as HTTP statuses and OpenAI error types.
HTTP_STATUS = {
    "invalid": 400,
    "unauthenticated": 401,
    "overloaded": 503,
    "unavailable": 503,
    # Not by the client, which is gone then, but by the service (a replica stopping):
    # worth a retry, as an unavailable replica is.
    "cancelled": 503,
    "internal": 500,
}
HTTP_ERROR_TYPE = {
    "invalid": "invalid_request_error",
    "unauthenticated": "invalid_request_error",  # OpenAI's type for a bad key (code 401)
    "overloaded": "overloaded_error",
    "unavailable": "service_unavailable_error",
    "cancelled": "service_unavailable_error",
    "internal": "server_error",  # OpenAI's
}


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(lasts: list[RequestOutput], choices_per_prompt: int | None = None) -> dict[str, Any]:
    """Usage of a request whose choices ended with these outputs: each prompt counted once,
    as OpenAI does (its choices are `choices_per_prompt` in a row; None: one prompt), the
    completions of every choice summed."""
    firsts = lasts[:: choices_per_prompt or len(lasts)]
    prompt = sum(out.num_prompt_tokens for out in firsts)
    completion = sum(out.num_output_tokens for out in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in firsts)},
    }


@dataclass(frozen=True)
class Echo:
    """A completion request's prompt, to echo before its choices' text (`echo`), with the
    alternatives its logprobs show (the request's `logprobs`; the engine may have computed
    more, for `prompt_logprobs`)."""

    text: str
    token_ids: list[int]
    top_n: int | None  # None: logprobs not asked, so the echo has none


# A completion logprobs entry: a token and its logprob (None: an echoed first token).
_Entry = tuple[int, "TokenLogprob | None"]


class ResponseBuilder:
    """Builds one request's completion object, or its stream of chunks."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        decode_token: Callable[[int], str],
        token_bytes: Callable[[int], bytes],
        echoes: list[Echo | None] | None = None,
        prompt_logprobs: int | None = None,
        tool_names: list[str] | None = None,
        choices_per_prompt: int | None = None,
    ):
        """`echoes`: each prompt's echo (a completion's choices are `choices_per_prompt`
        per prompt, in prompt order; None: all are one prompt's); `tool_names`: the
        functions a chat's model may call, whose calls in its text become `tool_calls`
        (tool_parser.py); None: the text is all content."""
        self.chat = chat
        self.echoes = echoes or []
        self.n = choices_per_prompt
        self.tool_names = tool_names
        self._parsers: dict[int, ToolCallParser] = {}
        # vLLM's `prompt_logprobs` field: the alternatives it shows, None if not asked.
        self.prompt_logprobs = prompt_logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        # For logprobs: a token's text, and its exact bytes (the text of a token that
        # holds part of a UTF-8 character is U+FFFD).
        self.decode_token = decode_token
        self.token_bytes = token_bytes
        # Per choice: completions' text_offset (where its next token's text starts), and
        # whether a chat stream has sent its opening delta (the one with the role).
        self._text_offsets: dict[int, int] = {}
        self._opened: set[int] = set()

    def _echoed(
        self, prompt_lps: list[TokenLogprob] | None, index: int
    ) -> tuple[str, list[_Entry]]:
        """The prompt's text and logprob entries that go before choice `index`'s text:
        with echo, in its first output (the one that carries the prompt logprobs)."""
        echo = self.echoes[self._prompt_of(index)] if self.echoes else None
        if echo is None or index in self._opened:
            return "", []
        self._opened.add(index)
        if prompt_lps is None or echo.top_n is None:
            return echo.text, []
        first = (echo.token_ids[0], None)  # no context before it: no logprob
        shown = [replace(lp, top=lp.top[: echo.top_n]) for lp in prompt_lps]
        return echo.text, [first, *((lp.token_id, lp) for lp in shown)]

    def _vllm_prompt_logprobs(
        self, prompt_lps: list[TokenLogprob] | None
    ) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token (the first, with no context, None),
        its own logprob and rank and the top alternatives, keyed by token id."""
        if self.prompt_logprobs is None or prompt_lps is None:
            return None

        def entry(token: int, logprob: float, rank: int | None) -> dict[str, Any]:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.decode_token(token)}

        # The prompt token's own entry first, then the alternatives, as vLLM orders them.
        return [None] + [
            {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
            | {
                str(t): entry(t, v, rank)
                for rank, (t, v) in enumerate(lp.top[: self.prompt_logprobs], start=1)
            }
            for lp in prompt_lps
        ]

    def _logprobs(self, lps: list[TokenLogprob], index: int, prompt: list[_Entry] = ()) -> Any:
        if not lps and not prompt:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": self.decode_token(lp.token_id),
                        "logprob": lp.logprob,
                        "bytes": list(self.token_bytes(lp.token_id)),
                        "top_logprobs": [
                            {
                                "token": self.decode_token(t),
                                "logprob": v,
                                "bytes": list(self.token_bytes(t)),
                            }
                            for t, v in lp.top
                        ],
                    }
                    for lp in lps
                ]
            }
        entries = [*prompt, *((lp.token_id, lp) for lp in lps)]
        tokens = [self.decode_token(token) for token, _ in entries]
        offsets = []
        offset = self._text_offsets.get(index, 0)
        for token in tokens:  # as vLLM counts them: each token's own text, in turn
            offsets.append(offset)
            offset += len(token)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob if lp else None for _, lp in entries],
            # The sampled token is always among them, as in OpenAI's and vLLM's (so up to
            # logprobs + 1 entries when it was not among the most likely). Keys are text,
            # which distinct tokens can share (partial UTF-8 all reads "\ufffd"): the
            # sampled token's own logprob wins, as token_logprobs gives it. An echoed
            # prompt's first token has none (null), as in OpenAI's.
            "top_logprobs": [
                {self.decode_token(t): v for t, v in lp.top} | {tokens[i]: lp.logprob}
                if lp
                else None
                for i, (_, lp) in enumerate(entries)
            ],
            "text_offset": offsets,
        }

    def _finish(self, out: RequestOutput) -> str | None:
        return out.finish_reason.value if out.finished and out.finish_reason else None

    def complete(self, choices: list[list[RequestOutput]]) -> dict[str, Any]:
        """The completion object; `choices[i]`: every output of choice i, in order."""
        body = []
        for index, outputs in enumerate(choices):
            # Unstreamed, each prompt's first choice alone computes them
            # (openai_api.choice_params).
            first = self._prompt_of(index) * (self.n or 0)
            prompt_lps = choices[first][0].prompt_logprobs
            vllm_prompt_logprobs = self._vllm_prompt_logprobs(prompt_lps)
            echoed, prompt = self._echoed(prompt_lps, index)
            text = echoed + "".join(o.new_text for o in outputs)
            lps = self._logprobs([lp for o in outputs for lp in o.new_logprobs], index, prompt)
            choice: dict[str, Any] = {
                "index": index,
                "logprobs": lps,
                "finish_reason": self._finish(outputs[-1]),
            }
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
                if self.tool_names is not None:
                    parser = ToolCallParser(self.tool_names)
                    content, calls = parser.feed(text)
                    content += parser.finish()
                    self._with_calls(choice, "message", content, calls, range(len(calls)))
            else:
                choice["text"] = text
                if self.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs
            body.append(choice)
        completion = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": body,
            "usage": usage([outputs[-1] for outputs in choices], self.n),
        }
        if self.chat and self.prompt_logprobs is not None:  # vLLM's: the request's, once
            completion["prompt_logprobs"] = vllm_prompt_logprobs
        return completion

    def chunk(self, out: RequestOutput, index: int = 0, include_usage: bool = False) -> str:
        """One SSE event for an output of choice `index`; a chat choice's first one also
        carries the assistant role. With `include_usage` it says `"usage": null`, as
        OpenAI's chunks before the usage chunk do."""
        echoed, prompt = self._echoed(out.prompt_logprobs, index)
        choice: dict[str, Any] = {
            "index": index,
            "logprobs": self._logprobs(out.new_logprobs, index, prompt),
            "finish_reason": self._finish(out),
        }
        if self.chat:
            choice["delta"] = {"content": out.new_text}
            if self.tool_names is not None:
                parser = self._parsers.setdefault(index, ToolCallParser(self.tool_names))
                first = parser.num_calls
                content, calls = parser.feed(out.new_text)
                if out.finished:
                    content += parser.finish()
                numbers = range(first, first + len(calls))
                self._with_calls(choice, "delta", content, calls, numbers, parser.num_calls)
            if index not in self._opened:
                self._opened.add(index)
                choice["delta"] = {"role": "assistant", **choice["delta"]}
        else:
            choice["text"] = echoed + out.new_text
        return self._event({"choices": [choice], **({"usage": None} if include_usage else {})})

    @staticmethod
    def _with_calls(
        choice: dict[str, Any],
        key: str,
        content: str,
        calls: list[tuple[str, str]],
        numbers: range,
        num_calls: int | None = None,
    ) -> None:
        """Sets a chat choice's content (None beside calls, when empty) and its calls
        (numbered `numbers` within the choice), and the finish reason OpenAI gives a
        choice that ended in calls; `num_calls`: the choice's calls so far (a stream's)."""
        made = len(calls) if num_calls is None else num_calls
        choice[key]["content"] = content if content or not calls else None
        if calls:
            choice[key]["tool_calls"] = [
                {
                    **({"index": i} if key == "delta" else {}),
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
                for i, (name, arguments) in zip(numbers, calls, strict=True)
            ]
        if made and choice["finish_reason"] == FinishReason.STOP.value:
            choice["finish_reason"] = "tool_calls"

    def usage_chunk(self, lasts: list[RequestOutput]) -> str:
        return self._event({"choices": [], "usage": usage(lasts, self.n)})

    def _prompt_of(self, index: int) -> int:
        return index // self.n if self.n else 0

    def _event(self, body: dict[str, Any]) -> str:
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            **body,
        }
        return f"data: {json.dumps(obj)}\n\n"


async def without_completion(
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`outputs` with no completion in them, for an echo of the prompt alone
    (`CompletionRequest.prompt_only`): its choices end at max_tokens 0, as OpenAI's do."""
    try:
        async for index, out in outputs:
            yield (
                index,
                replace(
                    out,
                    new_token_ids=[],
                    new_text="",
                    new_logprobs=[],
                    num_output_tokens=0,
                    finish_reason=FinishReason.LENGTH if out.finished else None,
                ),
            )
    finally:
        await outputs.aclose()


async def unaborted(
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) pairs, failing at a choice the server aborted (its replica
    shut down under it): OpenAI has no finish_reason for an answer cut short, so that is
    an error, a 503 before the first byte or an error event after it, which a client
    retries rather than taking the cut answer as whole. Closing it closes `outputs`, so
    the other choices' calls are cancelled at once."""
    try:
        async for index, out in outputs:
            if out.finish_reason is FinishReason.ABORT:
                raise EngineDeadError("the replica stopped before the request finished; retry it")
            yield index, out
    finally:
        await outputs.aclose()


def http_error(exc: BaseException) -> JSONResponse:
    """The error response for a request that failed before its first byte was sent."""
    kind, message = public_error(exc)
    status = HTTP_STATUS.get(kind, 500)
    cause = root_cause(exc)
    param = getattr(cause, "param", None)  # the field at fault, if one is
    if kind == "unauthenticated":  # as OpenAI answers a bad key
        body = error_body(message, HTTP_ERROR_TYPE[kind], code="invalid_api_key")
        return JSONResponse(body, status, headers={"WWW-Authenticate": "Bearer"})
    # A client backs off for at least this long before it retries a 503.
    headers = {"Retry-After": "1"} if status == 503 else None
    code = cause.code if isinstance(cause, InvalidRequestError) else None
    body = error_body(message, HTTP_ERROR_TYPE.get(kind, kind), param, code)
    return JSONResponse(body, status, headers=headers)


async def openai_http_error(raw: Request, exc: StarletteHTTPException) -> JSONResponse:
    """The response for a path or method the app does not serve (FastAPI's 404 / 405)."""
    kind = "invalid_request_error" if exc.status_code < 500 else HTTP_ERROR_TYPE["internal"]
    message = f"{exc.detail}: {raw.method} {raw.url.path}"
    return JSONResponse(error_body(message, kind), exc.status_code, headers=exc.headers)


async def sse_events(
    builder: ResponseBuilder,
    first: tuple[int, RequestOutput],
    rest: AsyncIterator[tuple[int, RequestOutput]],
    include_usage: bool,
) -> AsyncIterator[str]:
    """The SSE events of a request's choices, from (choice index, output) pairs; an error
    mid-stream (the status line is sent by then) is an error event, then `[DONE]`."""
    lasts = {first[0]: first[1]}
    yield builder.chunk(first[1], first[0], include_usage)
    try:
        async for index, out in rest:
            lasts[index] = out
            yield builder.chunk(out, index, include_usage)
    except Exception as e:  # mid-stream: the status line is sent, so an error event
        kind, message = public_error(e)
        body = error_body(message, HTTP_ERROR_TYPE.get(kind, kind))
        yield f"data: {json.dumps(body)}\n\n"
        yield DONE_EVENT  # the stream ends as every stream does (vLLM does too)
        return
    if include_usage:
        yield builder.usage_chunk([lasts[i] for i in sorted(lasts)])
    yield DONE_EVENT
