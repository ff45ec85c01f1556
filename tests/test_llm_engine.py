"""The engine end to end on a small random-weight Llama: its requests (checked, aborted,
generated all or none), stats and construction; what a step does with them is
test_llm_engine_step.py."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_helpers import GREEDY, _engine, _outputs
from tiny_model import random_prompts

from workers.engine.sampling_params import SamplingParams
from workers.errors import InvalidRequestError


def test_greedy_matches_transformers_generate(model_dir):
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = _engine(model_dir)
    for prompt in random_prompts(4):
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        assert _outputs(engine, [prompt]) == [expected]


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
    # The tiny model has 4 query heads and 2 KV heads: 1 and 2 divide both, 4 the query
    # heads (each KV head then on two ranks).
    with pytest.raises(ValueError, match=r"valid degrees: \[1, 2, 4\]"):
        _engine(model_dir, tensor_parallel_size=3)


def test_generate_adds_all_prompts_or_none(model_dir):
    engine = _engine(model_dir)
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([[5, 6, 7], []], GREEDY)
    assert not engine.has_unfinished()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_the_last_output_says_where_the_requests_time_went(model_dir):
    engine = _engine(model_dir, max_num_seqs=1)  # the second request queues behind the first
    for rid in ("a", "b"):
        engine.add_request(rid, [5, 6, 7, 8], GREEDY)
    outputs = {"a": [], "b": []}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    for rid, outs in outputs.items():
        assert all(o.timing is None for o in outs[:-1]), rid
        timing = outs[-1].timing
        assert timing is not None and outs[-1].finished
        assert timing.prefill_s > 0 and timing.decode_s > 0, timing
        assert timing.inference_s == timing.prefill_s + timing.decode_s
    # b waited for a's whole generation before it was scheduled.
    a, b = outputs["a"][-1].timing, outputs["b"][-1].timing
    assert b.queued_s >= a.inference_s > 0


def test_a_handoff_ends_the_prefill_engines_part_with_its_timing(model_dir):
    from handoff_helpers import _engine as handoff_engine
    from handoff_helpers import _handoff

    prefill, decode = handoff_engine(model_dir), handoff_engine(model_dir)
    first, *rest = _handoff(prefill, decode, "r", [5, 6, 7, 8, 9] * 8)
    assert first.timing is not None and first.timing.decode_s == 0.0
    assert rest[-1].timing is not None and rest[-1].timing.decode_s > 0


def test_a_prompt_longer_than_a_step_prefills_in_chunks_on_gguf_blocks(tmp_path):
    """A fresh engine on a quantized model whose first step is a chunk that samples
    nothing: its LM head gets no rows, which the block kernel must take. Run on a thread
    of its own, as an engine thread is, so no earlier test has given it scratch memory."""
    from conftest import write_tiny_gguf

    from workers.model.gguf_import import convert_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf", quantized=True)
    model = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    prompt = [5 + i % 50 for i in range(40)]  # 40 tokens: three chunks of at most 16
    results: list = []

    def run() -> None:
        engine = _engine(model, max_num_batched_tokens=16, max_num_seqs=4)
        results.append(_outputs(engine, [prompt], SamplingParams(max_tokens=4, temperature=0.0)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(results) == 1 and len(results[0][0]) == 4
