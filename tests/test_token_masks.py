"""workers/engine/token_masks.py: a step's masks, row for row as the sampler takes them."""

from __future__ import annotations

import pytest
import torch

from workers.engine.grammar_compiler import GrammarCompiler
from workers.engine.structured_output import StructuredOutput
from workers.engine.token_masks import TokenMasks
from workers.model.tokenizer import Tokenizer

VOCAB = 320


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf, VOCAB, {0})


@pytest.fixture(scope="module")
def masks(compiler):
    masks = TokenMasks(compiler.vocab_size)
    yield masks
    masks.shutdown()


def _id(tokenizer, ch: str) -> int:
    (token,) = tokenizer.hf.encode(ch, add_special_tokens=False).ids
    return token


def test_nothing_is_computed_for_a_step_without_a_grammar(masks):
    assert masks.start([(None, ()), (None, (5, 6))]) is None


def test_rows_follow_the_steps_row_order_with_each_draft_as_if_accepted(masks, compiler, tokenizer):
    a, b, c = (_id(tokenizer, ch) for ch in "abc")
    matcher = compiler.matcher(StructuredOutput("regex", "abc"))
    # Rows: an unconstrained sequence with one draft (rows 0-1), then the constrained one
    # with drafts "a", "b" (rows 2-4), then another unconstrained one (row 5).
    rows, allowed = masks.start([(None, (9,)), (matcher, (a, b)), (None, ())]).result()
    assert rows == [2, 3, 4]
    assert allowed.shape == (3, VOCAB) and allowed.dtype == torch.bool
    assert [set(r.nonzero().flatten().tolist()) for r in allowed] == [{a}, {b}, {c}]
    # The matcher is where it was: the drafts were rolled back.
    assert matcher.num_valid([a, b, c]) == 3


def test_after_a_draft_the_grammar_refuses_the_rows_repeat_the_last_valid_mask(
    masks, compiler, tokenizer
):
    a, x = _id(tokenizer, "a"), _id(tokenizer, "x")
    matcher = compiler.matcher(StructuredOutput("regex", "abc"))
    _, allowed = masks.start([(matcher, (x, a))]).result()
    assert allowed[0].nonzero().flatten().tolist() == [a]
    assert torch.equal(allowed[1], allowed[0]) and torch.equal(allowed[2], allowed[0])
    assert matcher.num_valid([a]) == 1
