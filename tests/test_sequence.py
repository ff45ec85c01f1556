"""A sequence's own bookkeeping: appending a sampled token and why it ends the sequence
(the engine's stop conditions end to end are in test_llm_engine_step.py)."""

from __future__ import annotations

from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason, Sequence

EOS = frozenset({2})
PROMPT = [5, 6, 7]


def _seq(**params) -> Sequence:
    return Sequence("r", list(PROMPT), SamplingParams(**{"max_tokens": 4, **params}))


def test_tokens_logprobs_and_first_token_time_are_recorded():
    seq = _seq()
    assert seq.append_token(9, None, now=10.0, eos_token_ids=EOS, max_model_len=64) is None
    assert seq.append_token(8, None, now=11.0, eos_token_ids=EOS, max_model_len=64) is None
    assert seq.output_token_ids == [9, 8] and seq.output_logprobs == []
    assert seq.first_token_time == 10.0
    assert seq.num_tokens == len(PROMPT) + 2


def test_eos_and_stop_token_ids_stop_unless_eos_is_ignored():
    assert _seq().append_token(2, None, 0.0, EOS, 64) is FinishReason.STOP
    assert _seq(stop_token_ids=[9]).append_token(9, None, 0.0, EOS, 64) is FinishReason.STOP
    assert _seq(ignore_eos=True).append_token(2, None, 0.0, EOS, 64) is None


def test_max_tokens_and_the_context_length_end_with_length():
    seq = _seq(max_tokens=2)
    assert seq.append_token(9, None, 0.0, EOS, 64) is None
    assert seq.append_token(9, None, 0.0, EOS, 64) is FinishReason.LENGTH
    # The prompt's 3 tokens plus one reach a context of 4.
    assert _seq().append_token(9, None, 0.0, EOS, len(PROMPT) + 1) is FinishReason.LENGTH
