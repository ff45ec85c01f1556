"""Sampler: greedy, top-k/top-p filters, temperature, seeded generators and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from workers.engine.sampler import (
    adjust_logits,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy,
    sample,
)
from workers.engine.sampling_params import SamplingParams

VOCAB = 32


def _logits(rows: int, seed: int, vocab: int = VOCAB, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _gen(seed: int) -> torch.Generator:
    """A per-request generator, seeded the way the engine seeds one."""
    return torch.Generator().manual_seed(seed)


def _default() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def test_greedy_is_argmax():
    logits = _logits(6, seed=0)
    params = [SamplingParams(temperature=0.0)] * 6
    out = sample(logits, params, [None] * 6, _default())
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_stay_argmax_in_a_batch_with_random_rows():
    logits = _logits(4, seed=1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0, top_p=0.9),
    ]
    out = sample(logits, params, [None] * 4, _default())
    argmax = logits.argmax(dim=1).tolist()
    assert out.token_ids[0] == argmax[0]
    assert out.token_ids[2] == argmax[2]


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = _logits(8, seed=2, scale=0.1)  # nearly flat: a real draw would wander
    for step in range(5):
        params = [SamplingParams(temperature=100.0, top_k=1, seed=step)] * 8
        out = sample(logits, params, [_gen(step) for _ in range(8)], _default())
        assert out.token_ids == logits.argmax(dim=1).tolist()


def test_the_largest_top_k_draws_as_if_top_k_were_off():
    logits = _logits(2, seed=3)
    largest = [SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=5)] * 2
    off = [SamplingParams(temperature=1.0, seed=5)] * 2
    drawn = sample(logits, largest, [_gen(5), _gen(6)], _default()).token_ids
    assert drawn == sample(logits, off, [_gen(5), _gen(6)], _default()).token_ids


def _seeded_run(
    seed: int, position: int, batch_size: int, steps: int = 40, default_seed: int = 1234
) -> list[int]:
    """Tokens a request seeded with `seed` gets at row `position` of a batch of `batch_size`.

    The other rows mix unseeded, greedy and differently seeded requests; every step
    sees fresh logits, identical for the seeded row whatever the batch looks like.
    `default_seed` seeds the engine-wide generator that unseeded rows draw from.
    """
    gens = [_gen(seed if row == position else 1000 + row) for row in range(batch_size)]
    others = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=5, seed=99),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]
    params, generators = [], []
    for row in range(batch_size):
        if row == position:
            params.append(SamplingParams(temperature=1.0, seed=seed))
            generators.append(gens[row])
        else:
            p = others[row % len(others)]
            params.append(p)
            generators.append(gens[row] if p.seed is not None else None)
    default = torch.Generator().manual_seed(default_seed)
    tokens = []
    for step in range(steps):
        logits = _logits(batch_size, seed=10_000 + step)
        logits[position] = _logits(1, seed=step)[0]
        tokens.append(sample(logits, params, generators, default).token_ids[position])
    return tokens


def test_seeded_sampling_is_reproducible():
    # The engine-wide generator differs between the runs: the same tokens can only come
    # from the request's own seed.
    first = _seeded_run(42, 0, 1, default_seed=1234)
    assert len(set(first)) > 5, "the logits were meant to give varied draws"
    assert _seeded_run(42, 0, 1, default_seed=5678) == first


@pytest.mark.parametrize(("position", "batch_size"), [(0, 3), (2, 5), (6, 7)])
def test_seeded_sampling_does_not_depend_on_the_rest_of_the_batch(position, batch_size):
    alone = _seeded_run(42, 0, 1)
    assert len(set(alone)) > 5, "the logits were meant to give varied draws"
    assert _seeded_run(42, position, batch_size) == alone


def test_different_seeds_give_different_tokens():
    a, b = _seeded_run(1, 0, 1), _seeded_run(2, 0, 1)
    assert sum(x != y for x, y in zip(a, b, strict=True)) > len(a) // 2


def test_apply_top_k_keeps_exactly_k_largest():
    logits = torch.tensor(
        [
            [0.3, 2.0, -1.0, 5.0, 1.0, 4.0],
            [9.0, 8.0, 7.0, 6.0, 5.0, 4.0],
            [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
            [1.0, -2.0, 3.0, -4.0, 5.0, -6.0],
        ]
    )
    out = apply_top_k(logits, torch.tensor([3, 1, 0, 10]))
    kept = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in out]
    assert kept[0] == {3, 5, 1}
    assert kept[1] == {0}
    assert kept[2] == set(range(6))  # 0 keeps all
    assert kept[3] == set(range(6))  # k beyond the vocabulary keeps all
    # Survivors keep their values.
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite])


def test_apply_top_k_all_zero_keeps_everything():
    logits = _logits(3, seed=3)
    assert torch.equal(apply_top_k(logits, torch.tensor([0, 0, 0])), logits)


@pytest.mark.parametrize("k", [1, 2, 5, 17, 31])
def test_apply_top_k_random_rows(k):
    logits = _logits(5, seed=k)
    out = apply_top_k(logits, torch.full((5,), k))
    for row_in, row_out in zip(logits, out, strict=True):
        expected = set(row_in.topk(k).indices.tolist())
        assert set(torch.isfinite(row_out).nonzero().flatten().tolist()) == expected


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.01, {1}),  # the top token always survives
        (1e-50, {1}),  # even where float32 makes top_p 0
        (0.5, {1}),  # its mass alone (0.5) already reaches p
        (0.6, {1, 3}),
        (0.79, {1, 3}),
        (0.9, {1, 3, 0}),
        (0.97, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_apply_top_p_keeps_the_minimal_prefix_reaching_p(top_p, kept):
    # Token 1: 0.5, token 3: 0.3, token 0: 0.15, token 2: 0.05.
    logits = _probs_logits([0.15, 0.5, 0.05, 0.3]).unsqueeze(0)
    out = apply_top_p(logits, torch.tensor([top_p]))
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == kept


def test_apply_top_p_matches_a_reference_on_random_rows():
    logits = _logits(16, seed=4, scale=3.0)
    top_p = torch.linspace(0.05, 0.95, 16)
    out = apply_top_p(logits, top_p)
    for row in range(16):
        probs = logits[row].double().softmax(dim=0)
        order = probs.argsort(descending=True).tolist()
        cumulative, expected = 0.0, set()
        for token in order:
            expected.add(token)
            cumulative += float(probs[token])
            if cumulative >= float(top_p[row]):
                break
        got = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
        assert got == expected
        assert int(logits[row].argmax()) in got


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_empirical_distribution_matches_softmax_over_temperature(temperature):
    raw = torch.tensor([1.0, 0.5, 0.0, -0.5])
    draws = 20_000
    logits = raw.expand(draws, -1).clone()
    params = [SamplingParams(temperature=temperature)] * draws
    out = sample(logits, params, [None] * draws, torch.Generator().manual_seed(7))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).double()
    target = (raw.double() / temperature).softmax(dim=0)
    untempered = raw.double().softmax(dim=0)
    # 3 degrees of freedom: 25 is far out in the tail (p < 1e-4) for a correct sampler,
    # while sampling at T = 1 instead lands in the hundreds.
    assert _chi_square(counts, target) < 25
    assert _chi_square(counts, untempered) > 100


def test_filters_are_applied_when_sampling():
    logits = _probs_logits([0.15, 0.5, 0.05, 0.3]).expand(2000, -1).clone()
    top_k = sample(logits, [SamplingParams(top_k=2)] * 2000, [None] * 2000, _default())
    assert set(top_k.token_ids) == {1, 3}
    top_p = sample(logits, [SamplingParams(top_p=0.9)] * 2000, [None] * 2000, _default())
    assert set(top_p.token_ids) == {0, 1, 3}


def test_logprobs_are_of_the_raw_logits_and_top_n_is_sorted():
    logits = _logits(3, seed=5)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.7, logprobs=3, seed=1),
        SamplingParams(temperature=0.4, top_k=4, logprobs=1, seed=2),
    ]
    out = sample(logits, params, [None, _gen(1), _gen(2)], _default())
    reference = logits.log_softmax(dim=1)
    for row, (p, lp) in enumerate(zip(params, out.logprobs, strict=True)):
        assert lp is not None
        assert lp.token_id == out.token_ids[row]
        assert math.isclose(lp.logprob, float(reference[row, lp.token_id]), abs_tol=1e-5)
        assert len(lp.top) == p.logprobs
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        want = reference[row].topk(p.logprobs)
        assert [t for t, _ in lp.top] == want.indices.tolist()
        assert values == pytest.approx(want.values.tolist(), abs=1e-5)


def test_logprobs_none_gives_none_and_zero_gives_no_alternatives():
    logits = _logits(3, seed=6)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    out = sample(logits, params, [None] * 3, _default())
    assert out.logprobs[0] is None
    assert out.logprobs[1] is not None
    assert out.logprobs[1].top == ()
    assert out.logprobs[1].token_id == out.token_ids[1]
    assert out.logprobs[2] is not None
    assert len(out.logprobs[2].top) == 2


def test_only_zero_logprobs_in_the_batch():
    logits = _logits(2, seed=8)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 2, [None] * 2, _default())
    for row, lp in enumerate(out.logprobs):
        assert lp is not None
        assert lp.top == ()
        expected = float(logits.log_softmax(dim=1)[row].max())
        assert math.isclose(lp.logprob, expected, abs_tol=1e-5)


def test_vanishing_temperature_is_greedy():
    # logits / 1e-40 overflows float32; such a request must still pick the argmax.
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    params = [SamplingParams(temperature=1e-40)]
    assert sample(logits, params, [None], torch.Generator().manual_seed(0)).token_ids == [2]


@pytest.mark.parametrize("vocab", [1000, 4096, 49152])
def test_greedy_equals_argmax_and_breaks_ties_low(vocab):
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy(logits), logits.argmax(dim=1))
    tied = torch.zeros(2, vocab)
    tied[0, [70, 5, 500]] = 2.0
    tied[1, [vocab - 1, 64]] = 1.0
    assert greedy(tied).tolist() == [5, 64]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(6)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = adjust_logits(logits, params, prompt_ids=[4, 4], output_ids=[1, 2, 2, 2])
    assert out.tolist() == [0.0, -0.75, -1.25, 0.0, 0.0, 0.0]
    assert logits.tolist() == [0.0] * 6  # the input is left alone


def test_repetition_penalty_shrinks_seen_logits_towards_zero_either_side():
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0])
    out = adjust_logits(logits, SamplingParams(repetition_penalty=2.0), [0], [1, 1])
    assert out.tolist() == [1.0, -4.0, 2.0, -2.0]


def test_logit_bias_is_added_before_the_penalties():
    logits = torch.tensor([1.0, 1.0, 1.0])
    params = SamplingParams(logit_bias={0: 3.0, 2: -5.0}, repetition_penalty=2.0)
    out = adjust_logits(logits, params, prompt_ids=[0, 2], output_ids=[])
    assert out.tolist() == [2.0, 1.0, -8.0]


def test_penalties_steer_greedy_and_leave_other_rows_and_logprobs_alone():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    history = [([2], [0]), ([2], [0])]
    out = sample(logits, params, [None, None], _default(), history)
    assert out.token_ids == [1, 0]
    # Reported logprobs are the model's own, as vLLM's default.
    assert out.logprobs[0].logprob == pytest.approx(float(logits[0].log_softmax(0)[1]))


def test_a_large_negative_bias_bans_a_token_and_a_positive_one_forces_it():
    logits = _logits(500, seed=9)
    ban = [SamplingParams(logit_bias={int(t): -100.0}) for t in logits.argmax(dim=1)]
    out = sample(logits, ban, [None] * 500, _default(), [([], [])] * 500)
    assert all(t != int(a) for t, a in zip(out.token_ids, logits.argmax(dim=1), strict=True))
    force = [SamplingParams(logit_bias={5: 100.0})] * 500
    assert set(sample(logits, force, [None] * 500, _default(), [([], [])] * 500).token_ids) == {5}


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = apply_min_p(probs, torch.tensor([0.2]))
    assert torch.equal(kept, torch.tensor([[0.5, 0.3, 0.15, 0.0]]))
    logits = _probs_logits([0.5, 0.3, 0.15, 0.05]).expand(2000, -1).clone()
    out = sample(logits, [SamplingParams(min_p=0.5)] * 2000, [None] * 2000, _default())
    assert set(out.token_ids) == {0, 1}


def test_short_of_min_tokens_stop_tokens_and_eos_are_banned():
    logits = torch.zeros(6)
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    banned = adjust_logits(logits, params, [], [1], eos_token_ids={5})
    assert banned.isinf().nonzero().flatten().tolist() == [3, 5]
    assert not adjust_logits(logits, params, [], [1, 2], eos_token_ids={5}).isinf().any()
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True)
    assert not adjust_logits(logits, ignoring, [], [], eos_token_ids={5}).isinf().any()


def test_a_mask_limits_its_rows_and_logprobs_are_of_the_masked_distribution():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.5], [3.0, 1.0, 2.0, 0.5]])
    allowed = torch.tensor([[False, True, True, False]])
    params = [SamplingParams(temperature=0.0, logprobs=4)] * 2
    out = sample(logits, params, [None, None], torch.Generator(), mask=([1], allowed))
    assert out.token_ids == [0, 2]  # the masked row takes its best allowed token
    masked = out.logprobs[1]
    assert {t for t, _ in masked.top} == {1, 2}  # impossible tokens are not alternatives
    assert abs(sum(math.exp(v) for _, v in masked.top) - 1.0) < 1e-6
    assert len(out.logprobs[0].top) == 4
    seeded = [SamplingParams(temperature=1.0, seed=s) for s in range(2)]
    for _ in range(20):
        gens = [torch.Generator().manual_seed(s) for s in range(2)]
        picked = sample(logits, seeded, gens, torch.Generator(), mask=([1], allowed)).token_ids
        assert picked[1] in (1, 2)
