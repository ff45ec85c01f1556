"""N-gram speculative decoding: the proposer, and the engine with it on (a small random-weight
Llama falls into repetition quickly, so its drafts are often right)."""

from __future__ import annotations

import itertools
import random

import pytest
from tiny_model import random_prompts

from workers.engine.config import EngineConfig, SpeculativeConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason, Sequence
from workers.engine.speculative import NgramSpeculator, ngram_drafts

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SPEC = SpeculativeConfig(num_tokens=4, max_running=8)


def _reference_drafts(tokens, num_tokens, lookup_min, lookup_max):
    """The proposer's contract, written as plainly as possible."""
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                extended = list(tokens)
                for _ in range(num_tokens):
                    extended.append(extended[len(extended) - (len(tokens) - start - n)])
                return extended[len(tokens) :]
    return []


def test_drafts_follow_the_latest_occurrence_of_the_longest_suffix():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 2, 3, 7, 8, 5, 2, 3, 4, 2, 3]
    # "2 3" last occurred at 9..10 (the suffix itself, at 12..13, does not count).
    assert ngram_drafts(tokens, 3, 1, 2) == [4, 2, 3]
    # The 3-gram "4 2 3" never occurred before, so the 2-gram decides.
    assert ngram_drafts(tokens, 3, 1, 3) == [4, 2, 3]
    # "9 2 3" at 3..5: a longer match wins over a later, shorter one.
    assert ngram_drafts([9, 2, 3, 6, 6, 2, 3, 5, 9, 2, 3], 2, 1, 3) == [6, 6]
    assert ngram_drafts([1, 2, 3, 4], 4, 1, 3) == []  # nothing repeats
    # Past the known tokens the copy goes on: a loop drafts in full.
    assert ngram_drafts([5, 5], 4, 1, 3) == [5, 5, 5, 5]
    assert ngram_drafts([7, 1, 2, 3, 1, 2], 5, 1, 2) == [3, 1, 2, 3, 1]
    assert ngram_drafts([5], 4, 1, 3) == []
    assert ngram_drafts([1, 2, 7, 1, 2], 3, 3, 3) == []  # shorter than lookup_min


def test_drafts_match_a_plain_search_on_random_tokens():
    # Tokens whose int32 bytes are mostly zeros make byte matches across token
    # boundaries likely: the proposer must ignore those.
    rng = random.Random(0)
    alphabet = [0, 1, 2, 256, 65536, 16777216, 257]
    for _ in range(2000):
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        k = rng.randint(1, 5)
        assert ngram_drafts(tokens, k, lo, hi) == _reference_drafts(tokens, k, lo, hi), tokens


def _decoding(request_id, prompt, output, max_tokens=10, prefill_only=False) -> Sequence:
    seq = Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens))
    seq.output_token_ids = list(output)
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.prefill_only = prefill_only
    return seq


def test_proposals_leave_room_for_max_tokens_and_the_context():
    spec = NgramSpeculator(SpeculativeConfig(num_tokens=4, max_running=8), max_model_len=100)
    loop = [3, 4, 3, 4, 3, 4]
    free = _decoding("free", loop, [3])
    near_max = _decoding("near", loop, [3, 4, 3], max_tokens=5)  # 2 more: 1 draft + 1
    at_max = _decoding("at", loop, [3, 4, 3, 4], max_tokens=5)
    prefilling = _decoding("pre", loop, [])
    prefilling.num_computed_tokens = 2
    handoff = _decoding("handoff", loop, [3], prefill_only=True)
    drafts = spec.propose([free, near_max, at_max, prefilling, handoff])
    assert drafts == {free: [4, 3, 4, 3], near_max: [4]}
    # A context of 8: after 7 tokens the next one is the last, so no draft fits.
    short = NgramSpeculator(SpeculativeConfig(num_tokens=4), max_model_len=len(loop) + 2)
    assert short.propose([_decoding("ctx", loop, [3])]) == {}
    assert list(short.propose([_decoding("ctx", loop, [])]).values()) == [[3]]


def test_no_proposals_past_max_running():
    spec = NgramSpeculator(SpeculativeConfig(max_running=2), max_model_len=100)
    seqs = [_decoding(str(i), [3, 4, 3, 4], [3]) for i in range(3)]
    assert len(spec.propose(seqs[:2])) == 2
    assert spec.propose(seqs) == {}


def test_a_sequence_whose_drafts_keep_failing_drafts_less_often():
    spec = NgramSpeculator(SpeculativeConfig(), max_model_len=100)
    seq = _decoding("s", [3, 4, 3, 4], [3])

    def drafted_steps(num_steps: int) -> list[int]:
        """The steps (of the next `num_steps`) in which `seq` drafts, each one a miss."""
        steps = []
        for step in range(num_steps):
            if spec.propose([seq]):
                steps.append(step)
                spec.record(seq, 4, 0)
        return steps

    # Pauses of 0, 1, 3, 7, then 15 steps after each miss in a row.
    assert drafted_steps(40) == [0, 1, 3, 7, 15, 31]
    assert drafted_steps(32) == [7, 23]
    # One accepted draft ends the pause after it and resets the count.
    while not spec.propose([seq]):
        pass
    spec.record(seq, 4, 1)
    assert drafted_steps(4) == [0, 1, 3]
    assert (spec.num_draft_tokens, spec.num_accepted_tokens) == (4 * 12, 1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_tokens": 0},
        {"num_tokens": 17},
        {"lookup_min": 0},
        {"lookup_min": 3, "lookup_max": 2},
        {"lookup_max": 17},
        {"max_running": 0},
    ],
)
def test_bad_speculative_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="speculative"):
        SpeculativeConfig(**kwargs)


def _engine(model_dir, speculative=SPEC, **overrides) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir), **{"num_kv_blocks": 256, "speculative": speculative, **overrides}
        )
    )


def _run(engine: LLMEngine, prompts, params=GREEDY) -> list[Sequence]:
    return engine.generate(prompts, params)


def test_greedy_output_is_unchanged_and_steps_are_fewer(model_dir):
    prompts = random_prompts(4)
    plain = _engine(model_dir, speculative=None)
    spec = _engine(model_dir)
    want = [s.output_token_ids for s in _run(plain, prompts)]
    got = _run(spec, prompts)
    assert [s.output_token_ids for s in got] == want
    assert all(s.finish_reason is FinishReason.LENGTH for s in got)
    stats = spec.stats()
    assert 0 < stats.num_accepted_draft_tokens <= stats.num_draft_tokens
    assert stats.num_steps < plain.stats().num_steps
    assert stats.num_generated_tokens == plain.stats().num_generated_tokens == 4 * 40
    assert stats.num_free_blocks == stats.num_total_blocks


def test_every_sampling_parameter_sees_the_drafts_before_it(model_dir):
    """Penalties, logit bias, min_tokens, stop tokens, logprobs: each row of a step is
    sampled with the history its position would have, so the tokens are the same."""
    prompts = random_prompts(3)
    free = [s.output_token_ids for s in _run(_engine(model_dir, speculative=None), prompts)]
    variants = [
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.1, "presence_penalty": 0.05},
        {"logit_bias": {free[0][3]: 3.0}},
        {"stop_token_ids": [free[1][6]], "min_tokens": 3, "ignore_eos": False},
        {"logprobs": 2},
    ]
    for extra in variants:
        params = SamplingParams(**{**vars(GREEDY), **extra})
        plain = _run(_engine(model_dir, speculative=None), prompts, params)
        spec_engine = _engine(model_dir)
        spec = _run(spec_engine, prompts, params)
        assert [s.output_token_ids for s in spec] == [s.output_token_ids for s in plain], extra
        assert [s.finish_reason for s in spec] == [s.finish_reason for s in plain], extra
        if "logprobs" in extra:
            for a, b in zip(spec, plain, strict=True):
                assert [lp.token_id for lp in a.output_logprobs] == a.output_token_ids
                assert [[t for t, _ in lp.top] for lp in a.output_logprobs] == [
                    [t for t, _ in lp.top] for lp in b.output_logprobs
                ]
        assert spec_engine.stats().num_accepted_draft_tokens > 0, extra


def test_output_never_passes_max_tokens_or_a_stop(model_dir):
    prompt = random_prompts(1)[0]
    engine = _engine(model_dir)
    for max_tokens in (1, 2, 3, 7):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        assert len(_run(engine, [prompt], params)[0].output_token_ids) == max_tokens
    # Each token of each output as a stop token: the output ends at its first occurrence,
    # also where that is a draft accepted in a step that had more drafts after it.
    inside_a_step = 0
    plain = _engine(model_dir, speculative=None)
    for start in random_prompts(4):
        # A prompt that already holds the loop the model falls into: the drafts match
        # from the first steps, before the output repeats its own tokens.
        prompt = start + _run(plain, [start])[0].output_token_ids[:16]
        free = _run(plain, [prompt])[0].output_token_ids
        # Where each step ends without a stop (its picks but the last match its drafts).
        engine.add_request("free", prompt, GREEDY)
        ends = []
        while engine.has_unfinished():
            ends += [len(o.new_token_ids) for o in engine.step()]
        ends = list(itertools.accumulate(ends))
        for stop in sorted(set(free)):
            params = SamplingParams(**{**vars(GREEDY), "stop_token_ids": [stop]})
            accepted_before = engine.stats().num_accepted_draft_tokens
            engine.add_request("r", prompt, params)
            outs = []
            while engine.has_unfinished():
                outs += engine.step()
            assert [t for o in outs for t in o.new_token_ids] == free[: free.index(stop) + 1]
            assert outs[-1].finish_reason is FinishReason.STOP
            inside_a_step += len(outs[-1].new_token_ids) > 1
            # Accepted drafts are the ones kept: each step's tokens but its last (the
            # model's own), or all of them where a stop ended the step at a draft; never
            # the drafts after the stop.
            i = free.index(stop)
            last = next(k for k, end in enumerate(ends) if end > i)  # the stop's step
            steps = [b - a for a, b in itertools.pairwise(ends[: last + 1])]
            kept = sum(n - 1 for n in steps[:-1])
            if steps:
                upto = i - ends[last - 1] + 1  # its step's tokens, up to the stop
                kept += upto if upto < steps[-1] else upto - 1
            accepted = engine.stats().num_accepted_draft_tokens - accepted_before
            assert accepted == kept, (stop, ends)
    assert inside_a_step > 0
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_stop_strings_and_text_are_unchanged(model_dir):
    """A stop string may end the output at a draft the model accepted, with more drafts
    after it in the same step: nothing past it is kept."""
    plain = _engine(model_dir, speculative=None)
    engine = _engine(model_dir)
    mid_step = 0
    for prompt in random_prompts(2):
        full = _run(plain, [prompt])[0].detokenizer.text
        for k in range(0, len(full) - 3, 2):
            params = SamplingParams(**{**vars(GREEDY), "stop": [full[k : k + 3]]})
            want = _run(plain, [prompt], params)[0]
            engine.add_request("r", prompt, params)
            outs, accepted = [], engine.stats().num_accepted_draft_tokens
            while engine.has_unfinished():
                before = engine.stats().num_accepted_draft_tokens
                outs += engine.step()
                accepted = engine.stats().num_accepted_draft_tokens - before
            assert [t for o in outs for t in o.new_token_ids] == want.output_token_ids
            assert "".join(o.new_text for o in outs) == want.detokenizer.text
            assert outs[-1].finish_reason is want.finish_reason
            # The last step's drafts taken outnumber the tokens it kept, less its own.
            mid_step += accepted >= len(outs[-1].new_token_ids)
    assert mid_step > 0
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_preemption_with_drafts_completes_everything_alike(model_dir):
    prompts = random_prompts(6)
    alone = [_run(_engine(model_dir, speculative=None), [p])[0].output_token_ids for p in prompts]
    small = _engine(model_dir, num_kv_blocks=8)
    assert [s.output_token_ids for s in _run(small, prompts)] == alone
    stats = small.stats()
    assert stats.num_preemptions > 0 and stats.num_accepted_draft_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_prefix_cache_holds_only_accepted_tokens(model_dir):
    """Blocks a speculating request filled are found by a later request with the same
    tokens, and give the same continuation: rejected drafts never reach a cached block."""
    prompt = random_prompts(1)[0]
    engine = _engine(model_dir)
    first = _run(engine, [prompt])[0].output_token_ids
    # The first request's prompt and output as a prompt: nearly all of it is cached.
    follow = prompt + first
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cached = _run(engine, [follow], params)[0]
    assert cached.num_cached_tokens >= (len(follow) - 1) // 16 * 16 > 0
    fresh = _run(
        _engine(model_dir, speculative=None, enable_prefix_caching=False), [follow], params
    )
    assert cached.output_token_ids == fresh[0].output_token_ids


def test_seeded_sampling_gives_the_tokens_it_gets_without_speculation(model_dir):
    """A seeded request's generator ends each step as if only its kept rows had drawn, so
    its tokens do not depend on speculation, nor on what else shares its batch."""
    prompts = random_prompts(6)
    seeded = SamplingParams(max_tokens=30, temperature=0.1, top_k=5, seed=7, ignore_eos=True)
    want = _run(_engine(model_dir, speculative=None), prompts[:1], seeded)[0].output_token_ids
    engine = _engine(model_dir)
    assert _run(engine, prompts[:1], seeded)[0].output_token_ids == want
    stats = engine.stats()
    # Both kinds of step happened: drafts taken, and drafts refused (rows discarded).
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    # In a batch of 6 that speculates only while at most 3 run: the others finish one
    # after another, so the seeded request decodes first without drafts, then with them
    # beside the last two others, then alone.
    others = [
        SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True) for n in (4, 6, 8, 10, 12)
    ]
    busy = _engine(model_dir, speculative=SpeculativeConfig(max_running=3))
    assert _run(busy, prompts, [seeded, *others])[0].output_token_ids == want
    assert busy.stats().num_draft_tokens > 0


def test_a_sequence_holds_no_blocks_past_its_tokens_between_steps(model_dir):
    engine = _engine(model_dir, num_kv_blocks=64, block_size=4)
    for i, prompt in enumerate(random_prompts(3)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            assert len(seq.block_tables[0]) <= engine.kv.blocks_for_tokens(seq.num_tokens)
    stats = engine.stats()
    assert stats.num_accepted_draft_tokens < stats.num_draft_tokens  # some were refused
    assert stats.num_free_blocks == stats.num_total_blocks


def test_abort_mid_speculation_frees_everything(model_dir):
    engine = _engine(model_dir)
    prompts = random_prompts(3)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(6):
        engine.step()
    assert engine.stats().num_draft_tokens > 0
    assert engine.abort("r1")
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.slow
def test_real_model_greedy_output_is_unchanged(smollm2_dir):
    """SmolLM2 (fp32): text, chat, code and unicode prompts give the same tokens with
    speculation as without, alone and as a batch, while drafts are taken."""
    plain = LLMEngine(EngineConfig(model=str(smollm2_dir)))
    tok = plain.tokenizer
    prompts = [
        tok.encode("The history of the printing press began when"),
        tok.encode_chat([{"role": "user", "content": "List three facts about honey bees."}]),
        tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
        tok.encode("Les élèves ont étudié « l'été » à Zürich — 東京 also"),
    ]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = [s.output_token_ids for s in plain.generate(prompts, params)]
    spec = LLMEngine(EngineConfig(model=str(smollm2_dir), speculative=SpeculativeConfig()))
    assert [s.output_token_ids for s in spec.generate(prompts, params)] == want
    assert spec.generate(prompts[2:3], params)[0].output_token_ids == want[2]
    stats = spec.stats()
    assert stats.num_accepted_draft_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks
