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
# A text longer than HEAD_PROBES[-1] characters per context token is tokenized only once
# a head of it, of each probe's characters per context token in turn, falls short of the
# context: a dense text (digits, CJK, symbols: 1-3 characters per token) is refused on the
# short head, natural text (3-5) on the long one, and the whole text only ever when its
# long head is so compressible that the rest might fit.
HEAD_PROBES = (1, 8)
# How far back from a head's end a whitespace character to cut at is looked for.
_HEAD_CUT_SEARCH = 4096
# A head with no whitespace near its end is cut inside a word, whose last tokens may then
# differ from the whole text's: it is refused only past the limit by this many tokens.
_CUT_WORD_SLACK = 16


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
        """The prompt's token ids (check_size first, for a prompt that may be huge). A text
        is refused as soon as its start alone is past what it may hold: the context less
        one generated token `to_generate` from, else (Tokenize, counting) the context.
        Tokenizing the rest would cost the router seconds for nothing (`_check_head`)."""
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
        most = self.max_model_len - 1 if to_generate else self.max_model_len
        self._check_head(text, special, field, most)
        ids = self.tokenizer.encode(text, add_special_tokens=special)
        if not to_generate and len(ids) > most:
            raise self._too_long(field, f"the text is {len(ids)} tokens", to_generate)
        return ids

    def _check_head(self, text: str, special: bool, field: str, most: int) -> None:
        """Refuses a long text (past HEAD_PROBES[-1] characters per context token) as
        soon as a head of it holds more than `most` tokens. A head is cut before a
        whitespace character, where pre-tokenizers split, so its tokens are the whole
        text's first ones; without one, inside a word (`_CUT_WORD_SLACK`)."""
        if len(text) <= HEAD_PROBES[-1] * self.max_model_len:
            return  # short enough to tokenize whole at little cost
        to_generate = most < self.max_model_len
        for chars_per_token in HEAD_PROBES:
            limit = chars_per_token * self.max_model_len
            start = max(limit - _HEAD_CUT_SEARCH, 0)
            cut = max(text.rfind(" ", start, limit), text.rfind("\n", start, limit))
            head, slack = (text[:cut], 0) if cut > 0 else (text[:limit], _CUT_WORD_SLACK)
            num_tokens = len(self.tokenizer.encode(head, add_special_tokens=special))
            if num_tokens > most + slack:
                found = f"its first {len(head)} characters alone are {num_tokens} tokens"
                raise self._too_long(field, found, to_generate)

    def _too_long(self, field: str, found: str, to_generate: bool) -> InvalidRequestError:
        if to_generate:
            limit = (
                f"this model's maximum context length is {self.max_model_len} tokens, the "
                "prompt and at least one generated token; shorten the prompt"
            )
        else:
            limit = (
                f"Tokenize counts at most this model's context length of {self.max_model_len}"
                " tokens; count a longer text in parts"
            )
        return InvalidRequestError(
            f"{field}: {found}; {limit}", param=field, code=CONTEXT_LENGTH_EXCEEDED
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
