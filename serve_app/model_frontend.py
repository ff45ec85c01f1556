"""The model as the router sees it: tokenizer, chat template, limits and block hashing.

Both public surfaces (gRPC and OpenAI HTTP) turn a request into a `PromptInput` and
`SamplingParams`; `ModelFrontend` tokenizes the prompt, checks the request against the
model (the engine's own checks, so bad input is refused before it costs a replica
anything) and hashes the prompt's full blocks exactly as the engines do; the engines'
token ids become text again in `text_stream`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from serve_app.protocol import EngineRequest
from serve_app.streaming.text_stream import TextStream, engine_params
from workers.engine import (
    CONTEXT_LENGTH_EXCEEDED,
    GrammarCompiler,
    InvalidRequestError,
    SamplingParams,
    check_prompt_fits,
    check_request,
    check_text,
    hash_full_blocks,
    root_hash,
)
from workers.model import ModelConfig, Tokenizer, eos_token_ids

# Messages in one chat prompt (OpenAI's own bound): each costs the chat template a render,
# so a body of a million empty ones would hold the tokenizing thread for seconds.
MAX_MESSAGES = 2048
# What the chat template adds per message (role markers), for the size of the work.
_TEMPLATE_CHARS_PER_MESSAGE = 16
# A prompt to generate from whose head of this many characters per context token
# already fills the context is refused on that head alone (natural text runs 3-5
# characters per token, so only prompts far past the context are probed).
HEAD_CHARS_PER_TOKEN = 8
# How far back from the head's end a whitespace character to cut at is looked for.
_HEAD_CUT_SEARCH = 4096


@dataclass(frozen=True)
class PromptInput:
    """Exactly one of text, chat messages or token ids; with messages, the tools offered
    (OpenAI's function entries, for the chat template)."""

    text: str | None = None
    # (role, content), or for an assistant turn that called tools (role, content, calls)
    # with each call's (id, function name, arguments as JSON text).
    messages: tuple[tuple[str, str] | tuple[str, str, tuple[ToolCall, ...]], ...] | None = None
    # Any sequence: a gRPC request's repeated field is copied only once its size is checked.
    token_ids: Sequence[int] | None = None
    tools: tuple[dict[str, Any], ...] = ()
    # For a text prompt: the tokenizer adds its special tokens (BOS), as for generation.
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.text, self.messages, self.token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError(
                "prompt: give exactly one of text, chat messages or token ids"
            )
        if self.messages is not None and len(self.messages) > MAX_MESSAGES:
            raise InvalidRequestError(
                f"messages: at most {MAX_MESSAGES} messages, got {len(self.messages)}",
                param="messages",
            )

    def num_chars(self) -> int:
        """Characters to tokenize: the text, or all messages' with their template's markup;
        0 for token ids."""
        if self.messages is not None:
            markup = _TEMPLATE_CHARS_PER_MESSAGE * len(self.messages)
            calls = sum(
                len(n) + len(a) + _TEMPLATE_CHARS_PER_MESSAGE
                for m in self.messages
                for _, n, a in _calls(m)
            )
            tools = sum(len(json.dumps(t)) for t in self.tools)
            return markup + calls + tools + sum(len(m[1]) for m in self.messages)
        return len(self.text or "")

    def chat(self) -> list[dict[str, Any]]:
        """The messages in OpenAI's shape, for the chat template."""
        turns = []
        for m in self.messages or ():
            turn: dict[str, Any] = {"role": m[0], "content": m[1]}
            if calls := _calls(m):
                turn["tool_calls"] = [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                    for i, n, a in calls
                ]
            turns.append(turn)
        return turns


# One tool call of an assistant turn: (id, function name, arguments as JSON text).
ToolCall = tuple[str, str, str]


def _calls(message: tuple) -> tuple[ToolCall, ...]:
    return message[2] if len(message) > 2 else ()


class ModelFrontend:
    def __init__(self, model_dir: Path, model_id: str, block_size: int, max_model_len: int):
        """`max_model_len`: the engines' context length (AppConfig.context_length)."""
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = Tokenizer(model_dir)
        self.model_id = model_id
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = sorted(
            eos_token_ids(model_dir, self.model_config.eos_token_ids, self.tokenizer)
        )
        # No token stands for more characters than its vocabulary entry has (a byte-level
        # BPE entry spells one character per byte), so a prompt of more characters than
        # the context's worth of the longest entry cannot fit, however it tokenizes.
        longest = max(len(token) for token in self.tokenizer.hf.get_vocab(with_added_tokens=True))
        self.max_prompt_chars = max_model_len * longest
        # Structured-output specs are compiled here first: one that does not compile is
        # refused before it costs a replica anything.
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.vocab_size, self.eos_token_ids)

    def check_size(self, prompt: PromptInput) -> None:
        """Refuses a prompt that cannot fit the context before any work is spent on it
        (tokenizing megabytes of text holds a core for seconds)."""
        if prompt.token_ids is not None:
            check_prompt_fits(len(prompt.token_ids), self.max_model_len)
            return
        if prompt.num_chars() > self.max_prompt_chars:
            field = "messages" if prompt.messages is not None else "prompt"
            raise InvalidRequestError(
                f"{field}: {prompt.num_chars()} characters cannot fit this model's context of "
                f"{self.max_model_len} tokens (at most {self.max_prompt_chars} could); "
                "shorten the prompt",
                param=field,
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    def tokenize(self, prompt: PromptInput, to_generate: bool = False) -> list[int]:
        """The prompt's token ids (check_size first, for a prompt that may be huge). One
        `to_generate` from is refused as soon as its start alone is past the context:
        tokenizing the rest would cost the router seconds for nothing (`_check_head`)."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)  # checked with the rest in build_request
        if prompt.messages is not None:
            if not prompt.messages:
                raise InvalidRequestError(
                    "messages must hold at least one message", param="messages"
                )
            if not self.tokenizer.has_chat_template:
                raise InvalidRequestError(
                    "messages: this model has no chat template; send a text prompt instead",
                    param="messages",
                )
            roles = {"system", "user", "assistant", "tool", "developer"}
            for i, (role, *_) in enumerate(prompt.messages):
                if role not in roles:
                    raise InvalidRequestError(
                        f"messages[{i}].role must be one of {sorted(roles)}, got {role!r}"
                    )
            for i, (_, content, *_) in enumerate(prompt.messages):
                check_text(content, f"messages.{i}.content")
            try:
                text = self.tokenizer.apply_chat_template(
                    prompt.chat(), tools=list(prompt.tools) or None
                )
            except jinja2.TemplateError as e:  # e.g. the template's raise_exception()
                raise InvalidRequestError(
                    f"messages: the model's chat template refused them: {e}", param="messages"
                ) from e
            # The template writes any BOS itself, so the tokenizer must not add another.
            special, field = False, "messages"
        else:
            text = check_text(prompt.text, "prompt")
            special, field = prompt.add_special_tokens, "prompt"
        if to_generate:
            self._check_head(text, special, field)
        return self.tokenizer.encode(text, add_special_tokens=special)

    def _check_head(self, text: str, special: bool, field: str) -> None:
        """Refuses a text whose first HEAD_CHARS_PER_TOKEN x max_model_len characters
        already hold the context's worth of tokens. The head is cut before a whitespace
        character, where pre-tokenizers split, so its tokens are the whole text's first
        ones: a long prompt costs one short tokenization before its 400."""
        limit = HEAD_CHARS_PER_TOKEN * self.max_model_len
        if len(text) <= limit:
            return
        head = text[:limit]
        cut = max(
            head.rfind(" ", limit - _HEAD_CUT_SEARCH), head.rfind("\n", limit - _HEAD_CUT_SEARCH)
        )
        if cut <= 0:
            return  # no boundary to cut at: the whole text is tokenized, as always
        num_tokens = len(self.tokenizer.encode(head[:cut], add_special_tokens=special))
        if num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"{field}: its first {cut} characters alone are {num_tokens} tokens; this "
                f"model's maximum context length is {self.max_model_len} tokens, the prompt "
                "and at least one generated token; shorten the prompt",
                param=field,
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    def detokenize(self, ids: list[int]) -> str:
        """Token ids' text, special tokens included; ids must exist in the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"tokens: token ids must be in [0, {self.vocab_size}), got {bad[:5]}",
                param="tokens",
            )
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def room_after(self, ids: list[int]) -> int:
        """Tokens the context has left after this prompt (the default budget); refuses a
        prompt that leaves none before any budget is checked, as the prompt's fault."""
        check_prompt_fits(len(ids), self.max_model_len)
        return self.max_model_len - len(ids)

    async def check_structured(self, params: SamplingParams) -> None:
        """InvalidRequestError naming the field when the request's output constraint does
        not compile (on a worker thread, within the compiler's time bound)."""
        if params.structured is not None:
            await self.grammars.prepare(params.structured)

    def build_request(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
    ) -> EngineRequest:
        """Checks a tokenized request; InvalidRequestError naming the field if it cannot run. The
        engine is asked for it without stop strings: the router applies them (TextStream)."""
        check_request(ids, params, self.vocab_size, self.max_model_len, cache_salt)
        hashes = hash_full_blocks(ids, self.block_size, root_hash(self.model_id, cache_salt))
        return EngineRequest(
            request_id, tuple(ids), engine_params(params), cache_salt, tuple(hashes)
        )

    def text_stream(self, ids: list[int], params: SamplingParams) -> TextStream:
        """Text and stop strings for the engine outputs of a request built from these."""
        return TextStream(self.tokenizer.hf, ids, params, self.eos_token_ids)
