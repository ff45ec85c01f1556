"""The engine end to end on a small random-weight Llama."""

from __future__ import annotations

import pytest
import torch
from tiny_model import make_tiny_model, random_prompts

from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.errors import InvalidRequestError
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 256, **overrides}))


def _outputs(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    return [s.output_token_ids for s in engine.generate(prompts, params)]


def test_greedy_matches_transformers_generate(model_dir):
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = _engine(model_dir)
    for prompt in random_prompts(4):
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        assert _outputs(engine, [prompt]) == [expected]


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


def test_abort_frees_blocks_and_others_finish(model_dir):
    engine = _engine(model_dir)
    for i, p in enumerate(random_prompts(3)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.abort("r1")
    assert not engine.abort("r1")
    assert not engine.abort("never-added")
    finished = set()
    while engine.has_unfinished():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"r0", "r2"}
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


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


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], GREEDY, "prompt"),
        ([5, 320], GREEDY, "prompt token ids"),
        ([5, -1], GREEDY, "prompt token ids"),
        ([5] * 1000, SamplingParams(max_tokens=100), "max_tokens"),
        ([5], SamplingParams(max_tokens=5, stop_token_ids=[999]), "stop_token_ids"),
    ],
)
def test_bad_requests_are_refused_before_scheduling(model_dir, prompt, params, field):
    engine = _engine(model_dir)
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished()
    # The engine serves the next request normally.
    assert len(_outputs(engine, [[5, 6, 7]])[0]) == GREEDY.max_tokens


def test_duplicate_request_id_is_refused(model_dir):
    engine = _engine(model_dir)
    engine.add_request("same", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("same", [1, 2, 3], GREEDY)


def test_the_context_length_is_what_the_kv_cache_holds_and_requests_past_it_are_refused(
    model_dir,
):
    engine = _engine(model_dir, num_kv_blocks=2)  # 2 blocks of 16 tokens
    assert engine.max_model_len == 32
    with pytest.raises(InvalidRequestError, match="maximum context length is 32") as err:
        engine.add_request("big", [5] * 30, SamplingParams(max_tokens=10))
    assert (err.value.param, err.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(InvalidRequestError, match="the prompt is 32 tokens") as err:
        engine.add_request("full", [5] * 32, SamplingParams(max_tokens=1))
    assert (err.value.param, err.value.code) == ("prompt", "context_length_exceeded")
    (fits,) = engine.generate([[5] * 22], SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(fits.output_token_ids) == 10


def test_stats_track_requests_and_blocks(model_dir):
    engine = _engine(model_dir)
    for i, p in enumerate(random_prompts(3)):
        engine.add_request(f"r{i}", p, GREEDY)
    assert engine.stats().num_waiting == 3
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 3 and stats.num_waiting == 0
    assert stats.num_free_blocks < stats.num_total_blocks
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.num_generated_tokens == 3 * GREEDY.max_tokens
    assert stats.num_free_blocks == stats.num_total_blocks


def test_tp_degree_must_divide_the_heads(model_dir):
    # The tiny model has 4 query heads and 2 KV heads: 1 and 2 divide both.
    with pytest.raises(ValueError, match=r"valid degrees: \[1, 2\]"):
        _engine(model_dir, tensor_parallel_size=3)


def test_generate_adds_all_prompts_or_none(model_dir):
    engine = _engine(model_dir)
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([[5, 6, 7], []], GREEDY)
    assert not engine.has_unfinished()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


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
