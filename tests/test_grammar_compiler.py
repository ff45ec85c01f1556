"""workers/engine/grammar_compiler.py and grammar_matcher.py: specs compiled once, refused
with the grammar engine's reason, and matchers that allow exactly what the grammar does."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiny_model import SPECIALS

from workers.engine.grammar_compiler import GrammarCompiler
from workers.engine.structured_output import StructuredOutput
from workers.errors import InvalidRequestError
from workers.model.tokenizer import Tokenizer

VOCAB = 320  # the tiny model's logits: 3 specials and 256 bytes, then unused ids
EOS = 0


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf, VOCAB, {EOS})


def _allowed(matcher, compiler) -> set[int]:
    bits = torch.zeros(1, (compiler.vocab_size + 31) // 32, dtype=torch.int32)
    matcher.fill(bits, 0)
    return {t for t in range(compiler.vocab_size) if bits[0, t // 32] >> (t % 32) & 1}


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.hf.encode(text, add_special_tokens=False).ids


def test_a_matcher_allows_what_the_grammar_does_and_ends_with_it(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutput.choice(["ab", "ac"]))
    assert _allowed(matcher, compiler) == set(_ids(tokenizer, "a"))
    assert matcher.accept(_ids(tokenizer, "a")[0])
    assert _allowed(matcher, compiler) == set(_ids(tokenizer, "b") + _ids(tokenizer, "c"))
    assert not matcher.done
    assert matcher.accept(_ids(tokenizer, "c")[0])
    assert matcher.done


def test_the_end_of_sequence_is_allowed_where_the_grammar_may_end(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutput("regex", "[0-9]+"))
    assert EOS not in _allowed(matcher, compiler)
    matcher.accept(_ids(tokenizer, "7")[0])
    allowed = _allowed(matcher, compiler)
    assert EOS in allowed and set(_ids(tokenizer, "0123456789")) < allowed
    # Ids past the tokenizer's vocabulary, and the chat markers, never are.
    assert not allowed & set(range(len(SPECIALS) + 256, VOCAB))


def test_a_spec_is_compiled_once_and_each_request_gets_its_own_matcher(compiler, tokenizer):
    spec = StructuredOutput.json_schema({"type": "object"})
    assert compiler.compile(spec) is compiler.compile(StructuredOutput("json", spec.spec))
    a, b = compiler.matcher(spec), compiler.matcher(spec)
    a.accept(_ids(tokenizer, "{")[0])
    assert _allowed(a, compiler) != _allowed(b, compiler)


def test_drafts_are_checked_against_the_grammar(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutput("regex", "abc"))
    assert matcher.num_valid(_ids(tokenizer, "abx")) == 2
    assert matcher.num_valid(_ids(tokenizer, "abc")) == 3


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (StructuredOutput.json_schema({"type": "strin"}, "guided_json"), "strin"),
        (StructuredOutput.json_schema({"type": "string", "format": "x"}, "guided_json"), "format"),
        (
            StructuredOutput.json_schema({"type": "array", "contains": {}}, "guided_json"),
            "Unimplemented keys.*contains",
        ),
        (StructuredOutput("regex", "[a-z", "guided_regex"), "regex"),
        (StructuredOutput("grammar", "start: foo", "guided_grammar"), "foo"),
        (StructuredOutput("grammar", "start: (", "guided_grammar"), "Expected token"),
        (StructuredOutput("grammar", "root ::= (", "guided_grammar"), "GBNF"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_with_the_engines_reason(compiler, spec, reason):
    with pytest.raises(InvalidRequestError, match=reason) as err:
        compiler.compile(spec)
    assert err.value.param == spec.param
    assert str(err.value).startswith(f"{spec.param}: ") and len(str(err.value)) < 700


def test_prepare_compiles_off_the_calling_thread_within_its_time_bound(compiler):
    spec = StructuredOutput.json_schema({"type": "array", "items": {"type": "integer"}})
    with pytest.raises(InvalidRequestError, match="took over 0 s to compile") as err:
        asyncio.run(compiler.prepare(spec, timeout_s=0))
    assert err.value.param == spec.param
    asyncio.run(compiler.prepare(spec))
    assert compiler.compile(spec) is compiler.compile(spec)
