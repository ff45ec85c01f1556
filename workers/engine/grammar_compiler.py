"""Structured-output specs compiled into token matchers, once per spec, for one tokenizer.

The grammar engine is llguidance: it runs on the CPU, compiles a JSON schema in about a
millisecond (it builds its lexer lazily, as masks are asked for), computes a mask over a
49k-token vocabulary in well under one (bench/structured_output.py measures both), takes
JSON schemas, regexes and Lark/GBNF grammars alike, and lets go of the GIL while it
works, so masks are computed while the model runs. Its limits bound every compile and
every mask step, so no spec can hold a replica.

Thread-safe: the router and an engine's callers compile on worker threads while the
engine thread copies compiled matchers for its sequences.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Collection

import llguidance
from tokenizers import Tokenizer as HFTokenizer

from workers.engine.grammar_matcher import GrammarMatcher
from workers.engine.structured_output import StructuredOutput
from workers.errors import InvalidRequestError

# Compiled specs kept, least recently used out first.
CACHE_SIZE = 256
# A compile that takes longer is refused (its thread finishes within the limits below).
COMPILE_TIMEOUT_S = 5.0
# llguidance's work bounds: lexer fuel runs at ~50k/ms when compiling, ~14k/ms per mask.
LIMITS = dict(
    initial_lexer_fuel=2_000_000,
    step_lexer_fuel=200_000,
    max_grammar_size=500_000,
    verbose_errors=False,
)
_MAX_REASON_CHARS = 600


class GrammarCompiler:
    def __init__(self, tokenizer: HFTokenizer, vocab_size: int, eos_token_ids: Collection[int]):
        """`vocab_size`: the model's logits width (a mask covers it; ids past the
        tokenizer's vocabulary are never allowed); `eos_token_ids`: the tokens that end a
        request, allowed wherever the grammar may end."""
        self._hf = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request (compiling the spec unless cached);
        InvalidRequestError naming the spec's field when it does not compile."""
        return GrammarMatcher(self.compile(spec).deep_copy())

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """The spec's compiled matcher in its start state, shared: copy it to use it."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    async def prepare(self, spec: StructuredOutput, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        """Compiles `spec` on a worker thread, so that a later `matcher` finds it cached;
        InvalidRequestError if it does not compile within `timeout_s`."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.compile, spec), timeout_s)
        except TimeoutError:
            raise InvalidRequestError(
                f"{spec.param}: took over {timeout_s:g} s to compile; simplify it",
                param=spec.param,
            ) from None

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        try:
            grammar = spec.grammar()
        except ValueError as e:
            raise self._refusal(spec, str(e)) from None
        matcher = llguidance.LLMatcher(
            self._llg_tokenizer(), grammar, log_level=0, limits=llguidance.LLParserLimits(**LIMITS)
        )
        if matcher.is_error():
            raise self._refusal(spec, matcher.get_error())
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """Built at the first compile (a few hundred ms for a 49k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                hf = HFTokenizer.from_str(self._hf.to_str())
                hf.no_padding()
                hf.no_truncation()
                self._tokenizer = llguidance.LLTokenizer(
                    hf.to_str(), n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    @staticmethod
    def _refusal(spec: StructuredOutput, reason: str) -> InvalidRequestError:
        reason = reason.strip()
        if len(reason) > _MAX_REASON_CHARS:
            reason = reason[: _MAX_REASON_CHARS - 3] + "..."
        return InvalidRequestError(f"{spec.param}: {reason}", param=spec.param)
