"""SamplingParams validation: every bad value is a ValueError naming the field and its range."""

from __future__ import annotations

import math
import re

import pytest

from workers.engine.sampling_params import MAX_LOGPROBS, SamplingParams, check_request
from workers.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature must be in [0, 100]"),
        ("temperature", -math.inf, "temperature must be in [0, 100]"),
        ("temperature", math.nan, "temperature must be in [0, 100]"),
        ("temperature", 100.5, "temperature must be in [0, 100]"),
        ("temperature", 1e39, "temperature must be in [0, 100]"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_p", -0.5, "top_p must be in (0, 1]"),
        ("top_p", 1.0001, "top_p must be in (0, 1]"),
        ("top_p", math.nan, "top_p must be in (0, 1]"),
        ("top_k", -2, "top_k must be an integer in [-1, 2147483647]"),
        ("top_k", 2.5, "top_k must be an integer in [-1, 2147483647]"),
        ("max_tokens", 0, "max_tokens must be an integer >= 1"),
        ("max_tokens", -3, "max_tokens must be an integer >= 1"),
        ("max_tokens", 8.0, "max_tokens must be an integer >= 1"),
        ("max_tokens", "8", "max_tokens must be an integer >= 1"),
        ("logprobs", -1, f"logprobs must be an integer in [0, {MAX_LOGPROBS}]"),
        ("logprobs", MAX_LOGPROBS + 1, f"logprobs must be an integer in [0, {MAX_LOGPROBS}]"),
        ("logprobs", 1.5, f"logprobs must be an integer in [0, {MAX_LOGPROBS}]"),
        ("prompt_logprobs", -1, f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}]"),
        ("prompt_logprobs", MAX_LOGPROBS + 1, "prompt_logprobs must be an integer in [0, 20]"),
        ("prompt_logprobs", True, "prompt_logprobs must be an integer"),
        ("seed", -1, "seed must be an integer in [0, 2**63)"),
        ("seed", 2**63, "seed must be an integer in [0, 2**63)"),
        ("seed", 1.5, "seed must be an integer in [0, 2**63)"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -2.01, "frequency_penalty must be in [-2, 2]"),
        ("frequency_penalty", math.nan, "frequency_penalty must be in [-2, 2]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be in [0.01, 10]"),
        # Smaller ones overflowed float32 in the sampler: NaN probabilities, token 0.
        ("repetition_penalty", 1e-39, "repetition_penalty must be in [0.01, 10]"),
        ("repetition_penalty", 11.0, "repetition_penalty must be in [0.01, 10]"),
        ("min_p", -0.1, "min_p must be in [0, 1]"),
        ("min_p", 1.5, "min_p must be in [0, 1]"),
        ("min_tokens", 17, "min_tokens must be an integer in [0, max_tokens=16]"),
        ("min_tokens", -1, "min_tokens must be an integer in [0, max_tokens=16]"),
    ],
)
def test_bad_value_names_field_and_range(field, value, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as err:
        SamplingParams(**{field: value})
    # The offending value is echoed back too, and the field is the error's param.
    assert repr(value) in str(err.value)
    assert err.value.param == field


def test_top_k_minus_one_means_off_as_in_vllm():
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


@pytest.mark.parametrize("stop", ["", ["ok", ""], ("",), [5]])
def test_empty_or_non_string_stop_is_rejected(stop):
    with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
        SamplingParams(stop=stop)


def test_non_integer_stop_token_id_is_rejected():
    with pytest.raises(ValueError, match="stop_token_ids must be integers"):
        SamplingParams(stop_token_ids=[1.5])


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 2.5},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"top_k": 50},
        {"max_tokens": 1},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"prompt_logprobs": 0},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"stop": ["a", "bc"], "stop_token_ids": [0, 5]},
        {"ignore_eos": True, "skip_special_tokens": False},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1.3, "min_p": 0.05},
    ],
)
def test_valid_values_pass(kwargs):
    params = SamplingParams(**kwargs)
    for field, value in kwargs.items():
        expected = tuple(value) if isinstance(value, list) else value
        assert getattr(params, field) == expected


def test_defaults():
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.seed is None
    assert params.logprobs is None
    assert params.stop == ()
    assert params.stop_token_ids == ()
    assert not params.greedy


def test_string_stop_becomes_a_one_tuple():
    assert SamplingParams(stop="###").stop == ("###",)


def test_lists_are_frozen_into_tuples():
    params = SamplingParams(stop=["x", "yz"], stop_token_ids=[3, 4])
    assert params.stop == ("x", "yz")
    assert params.stop_token_ids == (3, 4)
    # Frozen, so hashable and safe to share between requests.
    assert hash(params) == hash(SamplingParams(stop=("x", "yz"), stop_token_ids=(3, 4)))


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 3.0, "top_k": 1}, True),
        ({"temperature": 0.0, "top_p": 0.5}, True),
        ({"temperature": 1e-3}, False),
        ({"top_k": 2}, False),
        ({"top_p": 0.1}, False),
    ],
)
def test_greedy_property(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


@pytest.mark.parametrize("bad", [[100], [-1], [3, 100, 7], [1000]])
def test_check_against_rejects_stop_token_ids_outside_the_vocab(bad):
    params = SamplingParams(stop_token_ids=bad)
    with pytest.raises(ValueError, match=re.escape("stop_token_ids must be in [0, 100)")) as err:
        params.check_against(100)
    outside = [t for t in bad if not 0 <= t < 100]
    assert str(outside) in str(err.value)


def test_check_against_accepts_ids_inside_the_vocab():
    SamplingParams(stop_token_ids=[0, 99]).check_against(100)
    SamplingParams().check_against(1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"stop_token_ids": None}, "stop_token_ids"),
        ({"stop": 5}, "stop"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_wrong_types_are_value_errors_naming_the_field(kwargs, field):
    # The serving layer maps ValueError to INVALID_ARGUMENT / HTTP 400; a TypeError
    # would surface as an internal error.
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("bias", [{3: 101.0}, {"3": 1.0}, {True: 1.0}, {3: math.nan}, [(3,)]])
def test_a_bad_logit_bias_names_the_field_and_range(bias):
    with pytest.raises(ValueError, match=re.escape("logit_bias must map token ids to numbers")):
        SamplingParams(logit_bias=bias)


def test_logit_bias_is_frozen_sorted_and_checked_against_the_vocab():
    params = SamplingParams(logit_bias={7: -100, 2: 5})
    assert params.logit_bias == ((2, 5.0), (7, -100.0)) and params.adjusts_logits
    assert SamplingParams(logit_bias=[[7, -100], [2, 5]]) == params
    params.check_against(vocab_size=8)
    with pytest.raises(ValueError, match=re.escape("logit_bias token ids must be in [0, 7)")):
        params.check_against(vocab_size=7)


def test_only_penalties_bias_and_min_tokens_adjust_the_logits():
    assert not SamplingParams(min_p=0.2, top_k=3, temperature=0.5).adjusts_logits
    for kwargs in (
        {"presence_penalty": 0.1},
        {"frequency_penalty": -1},
        {"repetition_penalty": 1.1},
        {"logit_bias": {3: 1.0}},
        {"min_tokens": 2},
    ):
        assert SamplingParams(**kwargs).adjusts_logits


@pytest.mark.parametrize("field", ["ignore_eos", "skip_special_tokens"])
def test_flags_must_be_booleans(field):
    with pytest.raises(InvalidRequestError, match=f"{field} must be true or false") as err:
        SamplingParams(**{field: "false"})
    assert err.value.param == field


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("stop", ["x"] * 65, 64),
        ("stop_token_ids", [1] * 1025, 1024),
        ("logit_bias", {i: 1.0 for i in range(1025)}, 1024),
    ],
)
def test_the_lists_checked_at_every_token_are_bounded(field, value, limit):
    with pytest.raises(InvalidRequestError, match=f"^{field} takes at most {limit}") as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    at_limit = value[:limit] if isinstance(value, list) else dict(list(value.items())[:limit])
    SamplingParams(**{field: at_limit})


def test_a_stop_string_is_bounded_in_length():
    SamplingParams(stop=["x" * 1024])
    with pytest.raises(InvalidRequestError, match="at most 1024 characters, got one of 1025"):
        SamplingParams(stop=["x" * 1025])


def test_a_top_k_past_int32_is_refused_not_left_to_break_a_step():
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1
    with pytest.raises(InvalidRequestError, match=r"top_k must be .* in \[-1, 2147483647\]"):
        SamplingParams(top_k=2**64)


def test_a_token_biased_twice_is_refused():
    with pytest.raises(InvalidRequestError, match=r"each token id once, got \[7\]"):
        SamplingParams(logit_bias=[(7, 100.0), (8, 1.0), (7, 100.0)])


def test_a_stop_string_must_be_valid_unicode():
    with pytest.raises(InvalidRequestError, match="stop: not valid Unicode") as err:
        SamplingParams(stop=["ok", "\ud800"])
    assert err.value.param == "stop"


@pytest.mark.parametrize("token", [True, 2.0, "5"])
def test_prompt_token_ids_must_be_integers(token):
    with pytest.raises(InvalidRequestError, match="prompt token ids must be integers") as err:
        check_request([3, token], SamplingParams(), vocab_size=320, max_model_len=64)
    assert err.value.param == "prompt"
