"""The engine's step (LLMEngine.step) on a small random-weight Llama: the same tokens
however prompts are batched, chunked or preempted; stop conditions, text and
logprobs as each token is appended; sampling that no batch neighbour changes."""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY, _engine, _outputs
from tiny_model import make_tiny_model, random_prompts

from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason


def test_batch_and_chunked_prefill_give_the_same_tokens(model_dir):
    prompts = random_prompts(16)
    alone = [_outputs(_engine(model_dir), [p])[0] for p in prompts]
    batched = _engine(model_dir)
    assert _outputs(batched, prompts) == alone
    # A 7-token budget splits long prompts into chunks and mixes them with decodes.
    chunked = _engine(model_dir, max_num_batched_tokens=7, max_num_seqs=7)
    assert _outputs(chunked, prompts) == alone
    assert chunked.stats().num_steps > batched.stats().num_steps


def test_preemption_completes_everything_with_the_same_tokens(model_dir):
    prompts = random_prompts(8)
    alone = [_outputs(_engine(model_dir), [p])[0] for p in prompts]
    # 8 blocks of 16 hold at most ~128 tokens: a few sequences at a time.
    small = _engine(model_dir, num_kv_blocks=8)
    assert _outputs(small, prompts) == alone
    stats = small.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_streamed_text_equals_decoded_tokens(model_dir):
    engine = _engine(model_dir)
    prompt = engine.tokenizer.encode("Streaming: héllo 🙂 日本")
    engine.add_request("r", prompt, GREEDY)
    text, tokens = "", []
    while engine.has_unfinished():
        for out in engine.step():
            text += out.new_text
            tokens += out.new_token_ids
    assert text == engine.tokenizer.decode(tokens)


def test_finish_reasons(model_dir):
    engine = _engine(model_dir)
    prompt = random_prompts(1)[0]
    free_run = _outputs(engine, [prompt])[0]
    stop_token = free_run[5]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    stopped = engine.generate(
        [prompt], SamplingParams(**{**vars(params), "stop_token_ids": [stop_token]})
    )[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_token_ids == free_run[: free_run.index(stop_token) + 1]
    long = engine.generate([prompt], params)[0]
    assert long.finish_reason is FinishReason.LENGTH and len(long.output_token_ids) == 24


def test_eos_stops_unless_ignored(model_dir, tmp_path):
    prompt = random_prompts(1)[0]
    free_run = _outputs(_engine(model_dir), [prompt])[0]
    # The same weights, with the token the model emits at step 6 declared as EOS.
    eos = free_run[5]
    engine = _engine(make_tiny_model(tmp_path, eos_token_id=eos))
    stopped = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.output_token_ids == free_run[: free_run.index(eos) + 1]
    assert _outputs(engine, [prompt]) == [free_run]


def test_min_tokens_holds_off_eos_and_stop_tokens(model_dir, tmp_path):
    prompt = random_prompts(1)[0]
    free_run = _outputs(_engine(model_dir), [prompt])[0]
    eos = free_run[2]
    engine = _engine(make_tiny_model(tmp_path, eos_token_id=eos))
    # EOS forced at every step: min_tokens alone keeps the request going that long.
    forced = SamplingParams(max_tokens=24, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=5)
    out = engine.generate([prompt], forced)[0]
    assert out.finish_reason is FinishReason.STOP
    assert len(out.output_token_ids) == 6 and eos not in out.output_token_ids[:5]
    stop_token = free_run[1]
    params = SamplingParams(**{**vars(GREEDY), "stop_token_ids": [stop_token], "min_tokens": 4})
    held = engine.generate([prompt], params)[0].output_token_ids
    assert stop_token not in held[:4] and held[:1] == free_run[:1]


def test_stop_string_truncates_text(model_dir):
    engine = _engine(model_dir)
    prompt = engine.tokenizer.encode("stop strings")
    full = engine.generate([prompt], GREEDY)[0].detokenizer.text
    stop = full[10:13]
    seq = engine.generate([prompt], SamplingParams(**{**vars(GREEDY), "stop": [stop]}))[0]
    assert seq.finish_reason is FinishReason.STOP
    assert seq.detokenizer.text == full[: full.index(stop)]


def test_logprobs_are_returned_per_token(model_dir):
    engine = _engine(model_dir)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3)
    seq = engine.generate(random_prompts(1), params)[0]
    assert [lp.token_id for lp in seq.output_logprobs] == seq.output_token_ids
    for lp in seq.output_logprobs:
        assert len(lp.top) == 3
        # Greedy picks the most likely token, so it heads the top list.
        assert lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)


def test_seeded_sampling_is_reproducible_in_any_batch(model_dir):
    prompts = random_prompts(4)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = _outputs(_engine(model_dir), [prompts[0]], seeded)[0]
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batch = _engine(model_dir).generate(prompts, [seeded, others, others, others])
    assert batch[0].output_token_ids == alone
    other_seed = SamplingParams(**{**vars(seeded), "seed": 99})
    assert _outputs(_engine(model_dir), [prompts[0]], other_seed)[0] != alone


def test_penalties_and_logit_bias_steer_decoding_whatever_the_batch(model_dir):
    prompts = random_prompts(4)
    forced = SamplingParams(**{**vars(GREEDY), "logit_bias": {7: 100.0}})
    assert _outputs(_engine(model_dir), prompts[:1], forced)[0] == [7] * GREEDY.max_tokens
    plain = _outputs(_engine(model_dir), prompts[:1])[0]
    # A strong repetition penalty (on prompt and output) leaves greedy no repeat to pick.
    penalised = SamplingParams(**{**vars(GREEDY), "repetition_penalty": 10.0})
    alone = _outputs(_engine(model_dir), prompts[:1], penalised)[0]
    assert len(set(plain)) < len(plain) and len(set(alone)) == len(alone)
    assert not set(alone) & set(prompts[0])
    batch = _engine(model_dir).generate(prompts, [penalised, GREEDY, forced, GREEDY])
    assert batch[0].output_token_ids == alone
    assert batch[2].output_token_ids == [7] * GREEDY.max_tokens
    assert batch[1].output_token_ids == _outputs(_engine(model_dir), prompts[1:2])[0]
