"""vLLM's /tokenize and /detokenize bodies: a prompt (text or chat messages, with tools)
to token ids, and token ids back to text."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from serve_app.model_frontend import PromptInput
from serve_app.openai.requests import Body, ChatMessage
from serve_app.openai.tools import check_tools
from workers.engine import InvalidRequestError

# Token ids a detokenize call takes: as many as any context holds.
MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(Body):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    # Text prompts: the tokenizer's own special tokens (BOS) added, as for generation.
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError(
                "prompt: give exactly one of prompt (text) or messages", param="prompt"
            )
        for i, message in enumerate(self.messages or []):
            message.check(i)
        check_tools(self.tools)
        return self

    def prompt_input(self) -> PromptInput:
        if self.messages is None:
            return PromptInput(text=self.prompt, add_special_tokens=self.add_special_tokens)
        turns = tuple(m.turn(i) for i, m in enumerate(self.messages))
        return PromptInput(messages=turns, tools=tuple(self.tools))


class DetokenizeRequest(Body):
    model: str
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)
