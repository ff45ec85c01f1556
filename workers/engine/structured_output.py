"""What a request's output must match: a JSON schema, any JSON object, a regex, one of
a list of strings, or a grammar (Lark or GBNF/EBNF).

The spec is plain text, so it travels with `SamplingParams` from the router to prefill
and decode replicas, and each engine compiles it with its own tokenizer
(grammar_compiler.py). Two requests with the same spec share one compiled grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from llguidance import LLMatcher, grammar_from

from workers.errors import InvalidRequestError

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")
# A spec's text, at most: a realistic schema or grammar is a few KB, and each one costs
# its compile (bounded too, by the compiler's limits) and a cache entry.
MAX_SPEC_CHARS = 256 * 1024
MAX_CHOICES = 1024
# JSON is generated compact but spaced as Python's json.dumps spaces it (what models saw
# most): free whitespace lets a sampled model pad a value with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """`spec`: the JSON schema's text (json), the regex, the choices as a JSON array of
    strings (choice), the grammar (grammar); empty for json_object. `param` names the
    request field it came from, for error messages; it is not part of the spec."""

    kind: Kind
    spec: str = ""
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"{self.param}: the kind of constraint must be one of {list(KINDS)}, "
                f"got {self.kind!r}",
                param=self.param,
            )
        if not isinstance(self.spec, str):
            raise InvalidRequestError(f"{self.param}: must be text", param=self.param)
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(
                f"{self.param}: at most {MAX_SPEC_CHARS} characters, got {len(self.spec)}; "
                "simplify the schema or grammar",
                param=self.param,
            )
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(f"{self.param}: must not be empty", param=self.param)

    @classmethod
    def json_schema(cls, schema: Any, param: str = "structured_outputs.json") -> StructuredOutput:
        """A JSON schema given as an object (or its JSON text); `True` is any JSON value."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(
                    f"{param}: not valid JSON: {e.msg} at character {e.pos}", param=param
                ) from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"{param}: a JSON schema must be an object, got {type(schema).__name__}",
                param=param,
            )
        return cls("json", json.dumps(schema, ensure_ascii=False), param)

    @classmethod
    def choice(cls, options: Any, param: str = "structured_outputs.choice") -> StructuredOutput:
        ok = isinstance(options, (list, tuple)) and all(isinstance(o, str) for o in options)
        if not ok or not options or not all(options):
            raise InvalidRequestError(
                f"{param}: must be a non-empty list of non-empty strings", param=param
            )
        if len(options) > MAX_CHOICES:
            raise InvalidRequestError(
                f"{param}: at most {MAX_CHOICES} choices, got {len(options)}", param=param
            )
        return cls("choice", json.dumps(list(options), ensure_ascii=False), param)

    def grammar(self) -> str:
        """The spec as llguidance's grammar text (raises ValueError on a malformed one;
        the compiler checks the rest)."""
        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return grammar_from("choice", self.spec)
        return grammar_from("grammar", self.spec)  # Lark, or GBNF converted to it
