"""The OpenAI-compatible HTTP surface's translations: request bodies -> engine types, engine
outputs -> completion objects and SSE chunks.

Fields the engine cannot honour are refused when set to anything but their neutral
value (n > 1, penalties, echo...), rather than silently ignored; fields OpenAI clients
send that do not change the output (user, metadata...) are accepted and ignored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serve_app.prompts import PromptInput
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams, TokenLogprob

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Extensions (as vLLM names them).
    top_k: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True
    cache_salt: str | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise ValueError(f"n must be 1 (one choice per request), got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported; leave it at 0")

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids),
            stop=tuple(stop),
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompt_input(self) -> PromptInput:
        self.check_supported()
        if self.echo or self.suffix or (self.best_of or 1) != 1:
            raise ValueError("echo, suffix and best_of are not supported")
        if isinstance(self.prompt, str):
            return PromptInput(text=self.prompt)
        if self.prompt and all(isinstance(p, str) for p in self.prompt):
            if len(self.prompt) != 1:
                raise ValueError("prompt: send one prompt per request (a list of one string)")
            return PromptInput(text=self.prompt[0])
        return PromptInput(token_ids=tuple(self.prompt))

    def sampling_params(self, room: int) -> SamplingParams:
        """`room`: tokens the context has left after the prompt (unused: OpenAI's default
        for completions is 16 tokens)."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
        return self._params(max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"messages[{index}].content: only text parts are supported")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def prompt_input(self) -> PromptInput:
        self.check_supported()
        return PromptInput(messages=tuple((m.role, m.text(i)) for i, m in enumerate(self.messages)))

    def sampling_params(self, room: int) -> SamplingParams:
        """`room`: tokens the context has left after the prompt, the default budget."""
        max_tokens = self.max_completion_tokens or self.max_tokens or max(room, 1)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs)


def parse(model: type[_Request], body: Any) -> _Request:
    """A request model from a JSON body; ValueError naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise ValueError(f"{field}: {err['msg']}") from None


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


class ResponseBuilder:
    """Builds one request's completion object, or its stream of chunks."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        decode_token: Callable[[int], str],
        token_bytes: Callable[[int], bytes],
    ):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        # For logprobs: a token's text, and its exact bytes (the text of a token that
        # holds part of a UTF-8 character is U+FFFD).
        self.decode_token = decode_token
        self.token_bytes = token_bytes

    def _logprobs(self, lps: list[TokenLogprob]) -> Any:
        if not lps:
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
        return {
            "tokens": [self.decode_token(lp.token_id) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self.decode_token(t): v for t, v in lp.top} for lp in lps],
        }

    def _finish(self, out: RequestOutput) -> str | None:
        return out.finish_reason.value if out.finished and out.finish_reason else None

    def complete(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        last = outputs[-1]
        text = "".join(o.new_text for o in outputs)
        lps = self._logprobs([lp for o in outputs for lp in o.new_logprobs])
        choice: dict[str, Any] = {"index": 0, "logprobs": lps, "finish_reason": self._finish(last)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(last),
        }

    def chunk(self, out: RequestOutput | None, first: bool = False) -> str:
        """One SSE event for an output (None: the empty opening chunk of a chat stream)."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
        text = out.new_text if out is not None else ""
        if out is not None:
            choice["logprobs"] = self._logprobs(out.new_logprobs)
            choice["finish_reason"] = self._finish(out)
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        return self._event({"choices": [choice]})

    def usage_chunk(self, last: RequestOutput) -> str:
        return self._event({"choices": [], "usage": usage(last)})

    def _event(self, body: dict[str, Any]) -> str:
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            **body,
        }
        return f"data: {json.dumps(obj)}\n\n"


DONE_EVENT = "data: [DONE]\n\n"
