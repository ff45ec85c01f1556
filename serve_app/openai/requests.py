"""The OpenAI-compatible HTTP surface's requests: bodies -> engine types (reading a body
and bounding it before it is parsed is `serve_app/openai/body.py`, the responses are
`serve_app/openai/responses.py`).

Fields the engine cannot honour are refused when set to anything but their neutral value
(`serve_app/openai/unsupported.py`), rather than silently ignored; fields OpenAI clients
send that do not change the output (user, metadata...) are accepted and ignored. JSON
null means "the default" for every optional field, as in vLLM and SGLang. Every refusal
is an `InvalidRequestError` whose `param` is the field at fault (the OpenAI error body's
`param`).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from serve_app.model_frontend import PromptInput
from serve_app.openai.body import check_sizes
from serve_app.openai.structured import structured_output
from serve_app.openai.tools import ToolChoice, call_grammar, check_tools, tool_choice
from serve_app.openai.unsupported import check_unsupported
from workers.engine import (
    MAX_LOGPROBS,
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
    default_budget_room,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Choices per request: each is an engine request of its own.
MAX_CHOICES = 16
# A completion's batch of prompts, and its choices in all.
MAX_PROMPTS = 64
MAX_BATCH_CHOICES = 256

# A token id as a logit_bias key: ASCII digits, at most int64's 19 (more would only be
# refused later, after Python's int() had spent time on thousands of digits or refused
# them itself).
_TOKEN_ID = re.compile(r"-?[0-9]{1,19}", re.ASCII)


class Body(BaseModel):
    # Strict: true is not 1, "5" is not 5. Non-finite floats mean nothing to the sampler.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(Body):
    include_usage: bool = False
    # vLLM's: usage in every chunk. Not offered, so refused rather than ignored.
    continuous_usage_stats: bool = False

    @model_validator(mode="after")
    def _refuse_continuous_usage(self) -> StreamOptions:
        if self.continuous_usage_stats:
            raise InvalidRequestError(
                "stream_options.continuous_usage_stats: usage is sent once, in the last "
                "chunk (include_usage); accepted: false (or absent)",
                param="stream_options.continuous_usage_stats",
            )
        return self


class _Request(Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Token ids (JSON object keys, so strings) to a bias in [-100, 100].
    logit_bias: dict[str, float] = Field(default_factory=dict)
    # Extensions (as vLLM names them).
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    top_k: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True
    # As vLLM: a salt, if given, is not empty (gRPC's proto3 "" is no salt).
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM's: each prompt token's logprob, rank and this many alternatives, in the
    # response's `prompt_logprobs` (vLLM's -1, the whole vocabulary, is out of range).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Structured output (structured.py): OpenAI's, vLLM's, and vLLM's older fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Which grammar engine vLLM should use: the output is the same whichever does.
    guided_decoding_backend: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_unsupported(data, served=cls.model_fields)
            check_sizes(data)
        return data

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options: only allowed when stream is true", param="stream_options"
            )
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> _Request:
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError(
                "prompt_logprobs: not available with stream: true (as in vLLM); send the "
                "request unstreamed, or use echo with logprobs on /v1/completions",
                param="prompt_logprobs",
            )
        return self

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def prompt_inputs(self) -> list[PromptInput]:
        raise NotImplementedError

    def prompt_input(self) -> PromptInput:
        """The request's prompt, when it sent one (a completion may send a batch)."""
        prompts = self.prompt_inputs()
        if len(prompts) != 1:
            raise InvalidRequestError(
                f"prompt: one prompt expected here, got {len(prompts)}", param="prompt"
            )
        return prompts[0]

    def as_sent(self, error: InvalidRequestError) -> InvalidRequestError:
        """`error` with its `param` named as this request names the field: the engine's
        checks against the model name the prompt `prompt` and the budget `max_tokens`."""
        return error

    def _params(
        self, max_tokens: int, logprobs: int | None, echoed_logprobs: int | None = None
    ) -> SamplingParams:
        """`echoed_logprobs`: the alternatives an echoed prompt's logprobs show; the engine
        computes the most that either they or `prompt_logprobs` ask for."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        logit_bias = self._logit_bias()
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self._seed(),
                ignore_eos=self.ignore_eos,
                stop_token_ids=tuple(self.stop_token_ids),
                stop=tuple(stop),
                logprobs=logprobs,
                prompt_logprobs=max(
                    (n for n in (self.prompt_logprobs, echoed_logprobs) if n is not None),
                    default=None,
                ),
                skip_special_tokens=self.skip_special_tokens,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                min_p=self.min_p,
                logit_bias=logit_bias,
                min_tokens=self.min_tokens,
                structured=self.structured_output(),
            )
        except InvalidRequestError as e:
            # The engine's ranges are the ones that count, and its fields are named as the
            # request's (chat's top_logprobs and max_completion_tokens, named otherwise
            # there, are checked before this).
            if (e.param or "").split(".")[0] not in type(self).model_fields:
                e.param = None
            raise

    def structured_output(self) -> StructuredOutput | None:
        guided = {
            name: getattr(self, name)
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        }
        return structured_output(self.response_format, self.structured_outputs, guided)

    def _seed(self) -> int | None:
        # OpenAI takes any int64; the engine's seeds are [0, 2**63), which the negative
        # half maps onto (a seed names a stream; which one does not matter).
        if self.seed is not None and -(2**63) <= self.seed < 0:
            return self.seed + 2**63
        return self.seed

    def _logit_bias(self) -> dict[int, float]:
        # int() alone would also read " 1", "1_0" and non-ASCII digits, and "1" and "01"
        # would then name one token twice, the second bias silently winning.
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            if not _TOKEN_ID.fullmatch(key):
                raise InvalidRequestError(
                    "logit_bias: keys must be token ids (integers of at most 19 digits, as "
                    f"strings), got {key if len(key) <= 24 else key[:21] + '...'!r}",
                    param="logit_bias",
                )
            token = int(key)
            if token in bias:
                raise InvalidRequestError(
                    f"logit_bias: token {token} is named twice", param="logit_bias"
                )
            bias[token] = value
        return bias


class CompletionRequest(_Request):
    # Text, token ids, or a batch of either (each prompt gets n choices).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    # The prompt before the completion, in the text and, with logprobs, in the logprobs
    # (its tokens' own: what scoring a text by its likelihood takes, as lm-eval does).
    echo: bool = False
    # 0 with echo: the prompt alone (as OpenAI's legacy API and vLLM take it).
    max_tokens: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _no_tokens_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError(
                "max_tokens: 0 asks for no completion, which only echo: true makes a "
                "request of (the prompt alone); send at least 1",
                param="max_tokens",
            )
        if self.max_tokens == 0 and self.min_tokens:
            raise InvalidRequestError(
                f"min_tokens: must be 0 with max_tokens 0, got {self.min_tokens}",
                param="min_tokens",
            )
        return self

    @property
    def prompt_only(self) -> bool:
        """Echo with max_tokens 0: the engine samples one token, which is not returned."""
        return self.echo and self.max_tokens == 0

    def prompt_inputs(self) -> list[PromptInput]:
        """The prompts: one (text, or token ids) or a batch of either, each answered with
        `n` choices in turn, as OpenAI and vLLM number them."""
        if isinstance(self.prompt, str):
            return [PromptInput(text=self.prompt)]
        if not self.prompt or isinstance(self.prompt[0], int):
            return [PromptInput(token_ids=tuple(self.prompt))]
        if len(self.prompt) > MAX_PROMPTS:
            raise InvalidRequestError(
                f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(self.prompt)}",
                param="prompt",
            )
        if len(self.prompt) * self.n > MAX_BATCH_CHOICES:
            raise InvalidRequestError(
                f"n: {len(self.prompt)} prompts x n={self.n} choices is more than "
                f"{MAX_BATCH_CHOICES}; send fewer prompts per request",
                param="n",
            )
        return [
            PromptInput(text=p) if isinstance(p, str) else PromptInput(token_ids=tuple(p))
            for p in self.prompt
        ]

    def sampling_params(self, room: int) -> SamplingParams:
        """`room`: tokens the context has left after the prompt. Unsent, max_tokens is
        OpenAI's 16 (or min_tokens, if more), or less where the context has less room (as
        in vLLM)."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            default = max(DEFAULT_COMPLETION_MAX_TOKENS, self.min_tokens)
            max_tokens = min(default, default_budget_room(room, self.min_tokens))
        echoed = self.logprobs if self.echo else None
        return self._params(max(max_tokens, 1), self.logprobs, echoed)


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    # An assistant turn's calls: [{"id", "type": "function", "function": {"name",
    # "arguments" (JSON text)}}]; a tool turn answers one by its id.
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    # The deprecated form of tool_calls, refused.
    function_call: dict[str, Any] | None = None

    def check(self, index: int) -> None:
        """InvalidRequestError naming the field when this turn is malformed."""
        if self.function_call:
            where = f"messages.{index}.function_call"
            raise InvalidRequestError(
                f"{where}: the deprecated function call form is not supported; send tool_calls",
                param=where,
            )
        if self.tool_calls and self.role != "assistant":
            where = f"messages.{index}.tool_calls"
            raise InvalidRequestError(
                f"{where}: only an assistant message holds tool calls", param=where
            )
        for j, call in enumerate(self.tool_calls):
            _check_call(call, f"messages.{index}.tool_calls.{j}")
        if self.content is None and self.role != "assistant":
            where = f"messages.{index}.content"
            raise InvalidRequestError(
                f"{where}: a {self.role} message needs content (only an assistant's may be null)",
                param=where,
            )

    def turn(self, index: int) -> tuple:
        """This message as a PromptInput turn."""
        calls = tuple(
            (c.get("id", ""), c["function"]["name"], c["function"]["arguments"])
            for c in self.tool_calls
        )
        return (self.role, self.text(index), calls) if calls else (self.role, self.text(index))

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):
            where = f"messages.{index}.content.{j}"
            if part.get("type") != "text":
                raise InvalidRequestError(f"{where}: only text parts are supported", param=where)
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}.text: must be a string", param=f"{where}.text")
            parts.append(part["text"])
        return "".join(parts)


def _check_call(call: dict[str, Any], where: str) -> None:
    function = call.get("function")
    ok = (
        call.get("type", "function") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), str)
        and isinstance(call.get("id", ""), str)
    )
    if not ok:
        raise InvalidRequestError(
            f'{where}: a tool call is {{"id": ..., "type": "function", "function": {{"name": '
            '..., "arguments": "<JSON text>"}}',
            param=where,
        )


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Tools (tools.py): OpenAI's function entries, and which of them the model must call.
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    _tool_choice: ToolChoice = PrivateAttr()

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        check_tools(self.tools)
        self._tool_choice = tool_choice(self.tool_choice, self.tools, self.parallel_tool_calls)
        return self

    @property
    def tool_use(self) -> ToolChoice:
        return self._tool_choice

    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools the chat template renders: none when the model may not call them."""
        return self.tools if self.tool_use.mode != "none" else []

    def structured_output(self) -> StructuredOutput | None:
        constraint = super().structured_output()
        if not self.tool_use.forced:
            return constraint
        if constraint is not None:
            raise InvalidRequestError(
                f"tool_choice and {constraint.param}: a forced tool call is itself the output's "
                "constraint; send one of them",
                param="tool_choice",
            )
        return call_grammar(self.tools, self.tool_use)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs: requires logprobs: true", param="top_logprobs")
        return self

    @model_validator(mode="after")
    def _messages_are_text(self) -> ChatCompletionRequest:
        for i, message in enumerate(self.messages):
            message.check(i)
        return self

    def prompt_inputs(self) -> list[PromptInput]:
        turns = tuple(m.turn(i) for i, m in enumerate(self.messages))
        return [PromptInput(messages=turns, tools=tuple(self.offered_tools()))]

    def as_sent(self, error: InvalidRequestError) -> InvalidRequestError:
        if error.param == "prompt":
            error.param = "messages"
        elif error.param == "max_tokens" and self.max_completion_tokens is not None:
            error.param = "max_completion_tokens"
            error.args = (str(error).replace("max_tokens", error.param),)
        return error

    def sampling_params(self, room: int) -> SamplingParams:
        """`room`: tokens the context has left after the prompt, the default budget.
        max_completion_tokens wins over max_tokens, which OpenAI deprecates in its favour."""
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = default_budget_room(room, self.min_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs)


# Either endpoint's request, as parsed.
OpenAIRequest = CompletionRequest | ChatCompletionRequest


def choice_params(params: SamplingParams, n: int, stream: bool) -> list[SamplingParams]:
    """Each of `n` choices' parameters: a seeded request's choices draw from seeds
    seed, seed + 1, ... (as vLLM), else all would be the same. Unstreamed, only the first
    choice computes the prompt's logprobs, which the response gives every choice (a
    stream sends each choice's with its first chunk, before the others may have them)."""
    choices = [params] * n
    if params.seed is not None:
        choices = [replace(params, seed=(params.seed + i) % 2**63) for i in range(n)]
    if not stream and params.prompt_logprobs is not None:
        choices[1:] = [replace(p, prompt_logprobs=None) for p in choices[1:]]
    return choices


_FIELDS = {
    name
    for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, StreamOptions)
    for name in m.model_fields
}
# What a union field takes, said once (pydantic would name one alternative's error).
_UNION_TYPES = {
    "stop": "a string or an array of strings",
    "prompt": "a string, an array of token ids, or an array of one of either",
    "content": "a string or an array of text parts",
}


def parse(model: type[Body], body: Any) -> Body:
    """A request model from a JSON body; InvalidRequestError naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, InvalidRequestError):
            raise cause from None
        # The location, less pydantic's union-branch tags ("str", "list[str]"...).
        fields = _FIELDS | set(model.model_fields)
        path = [p for p in err["loc"] if isinstance(p, int) or p in fields]
        message = "must be a JSON object" if err["type"] == "model_type" else err["msg"]
        if path and len(path) < len(err["loc"]) and path[-1] in _UNION_TYPES:
            message = f"must be {_UNION_TYPES[path[-1]]}"
        param = ".".join(str(p) for p in path) or None
        raise InvalidRequestError(f"{param or 'body'}: {message}", param=param) from None
