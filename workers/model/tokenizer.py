"""The model's tokenizer and chat template, read from a Hugging Face model folder."""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from workers.model.tool_calls import inline_tools, parse_arguments

_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates written for
    # transformers (tool schemas, JSON arguments) expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks an assistant's
    tokens for training masks: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _template_environment() -> ImmutableSandboxedEnvironment:
    """What chat templates are written against: transformers' environment (loop
    controls, the generation tag, `strftime_now` for templates that date the system
    prompt, its `tojson`), so that a prompt renders as it does there and in vLLM."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationTag],
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


def _special_token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as a string or as an
    # AddedToken dict with a "content" key.
    if isinstance(value, dict):
        return value.get("content")
    return value


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """The character byte-level BPE writes for each byte (GPT-2's scheme): printable
    Latin-1 bytes stand for themselves, the other 68 take the code points from 256 up,
    in byte order. Inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return {c: b for b, c in chars.items()}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model: {model_dir} has no tokenizer.json")
        self.hf = HFTokenizer.from_file(str(path))
        spec = json.loads(self.hf.to_str())
        self._byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        self._added = {t["id"] for t in spec.get("added_tokens", [])}
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.eos_token = _special_token_text(config.get("eos_token"))
        # What a chat template sees of them, as under transformers: those set, by name.
        self._special_tokens = {
            name: text
            for name in _SPECIAL_TOKEN_NAMES
            if (text := _special_token_text(config.get(name))) is not None
        }
        template = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates; the default one serves chat
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._chat_template = None
        # OpenAI's developer messages are its system messages under a newer name; a
        # template that does not name the role renders them as system messages.
        self._renames_developer = bool(template) and "developer" not in template
        # A template that names them renders tools, calls and results itself; for one
        # that does not, tool_calls.inline_tools writes them into its messages.
        self.renders_tools = bool(template) and "tools" in template
        if template:
            self._chat_template = _template_environment().from_string(template)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.hf.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, unlike encode, releases the GIL while it works: a long prompt
        # tokenized on a worker thread then leaves the caller's event loop running.
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, exact even where it holds only part of a UTF-8
        character (then its decoded text is U+FFFD). Byte-level BPE vocabularies spell
        bytes as characters; SentencePiece ones write "▁" for a space and <0xNN> for a
        byte fallback."""
        token = self.hf.id_to_token(token_id)
        if token is None:  # a model may pad its vocabulary past the tokenizer's (Qwen2.5)
            return b""
        if token_id in self._added:  # added tokens are kept as written
            return token.encode()
        if self._byte_level:
            alphabet = _byte_level_alphabet()
            return b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode() for c in token)
        if m := _BYTE_FALLBACK.fullmatch(token):
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """`messages` in OpenAI's shape (an assistant's may carry `tool_calls`, a tool
        result has role "tool"); `tools`: OpenAI's function entries offered to the model."""
        if self._chat_template is None:
            raise ValueError("messages: this model has no chat template; send a plain prompt")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must have 'role' and 'content'")
        uses_tools = bool(tools) or any(
            m.get("tool_calls") or m["role"] == "tool" for m in messages
        )
        if uses_tools and not self.renders_tools:
            messages, tools = inline_tools(messages, tools), None
        elif uses_tools:
            messages = [_with_parsed_arguments(m) for m in messages]
        if self._renames_developer:
            messages = [
                {**m, "role": "system"} if m["role"] == "developer" else m for m in messages
            ]
        return self._chat_template.render(
            messages=messages,
            # Given as None, as transformers does: templates test `tools is not none`.
            tools=list(tools) if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        # The template writes any BOS itself, so the tokenizer must not add another.
        text = self.apply_chat_template(messages, tools=tools)
        return self.encode(text, add_special_tokens=False)


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """A turn for a template that renders tool calls: their arguments as objects (OpenAI
    sends JSON text, which a template's `tojson` would quote again)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        function = call["function"]
        arguments = parse_arguments(function["arguments"])
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": parsed}


def eos_token_ids(
    model_dir: str | Path, config_eos_ids: tuple[int, ...], tokenizer: Tokenizer
) -> frozenset[int]:
    """Every id that ends a completion: config.json's, generation_config.json's (chat
    models often add their end-of-turn token there) and the tokenizer's EOS token."""
    ids = set(config_eos_ids)
    gen_config = Path(model_dir) / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tok_eos = tokenizer.token_id(tokenizer.eos_token)
    if tok_eos is not None:
        ids.add(tok_eos)
    return frozenset(ids)
