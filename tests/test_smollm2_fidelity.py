"""The engine on the real SmolLM2-135M-Instruct against transformers' own model.

transformers loads the same GGUF file itself (its own dequantization and its own
un-permutation of Q/K), so agreement here checks the converter, the model and
the engine together.
"""

from __future__ import annotations

import copy

import pytest
import torch
from fidelity_helpers import PLAIN, last_position_logits

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
CHATS = [
    [{"role": "user", "content": "What is the boiling point of water?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a Python one-liner that reverses a string."},
    ],
]
LONG = (
    "The history of computing is a story of people and machines. "
    "Charles Babbage designed the Analytical Engine in the 1830s, and Ada Lovelace "
    "wrote what many call the first program for it. A century later, Alan Turing "
    "described a universal machine, and during the Second World War, engineers built "
    "electronic computers to break codes and compute artillery tables. "
) * 6 + "In summary, the most important idea in this history is"


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return LLMEngine(EngineConfig(model=str(smollm2_dir), num_threads=2))


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    ids = [tok.encode(p) for p in PLAIN] + [tok.encode_chat(m) for m in CHATS]
    ids.append(tok.encode(LONG))
    assert len(ids[-1]) > 300
    return ids


def _greedy(engine, prompts, max_tokens=NEW_TOKENS):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [s.output_token_ids for s in engine.generate(prompts, params)]


def test_greedy_tokens_match_transformers(engine, prompts, smollm2_reference):
    # Checked in one forward pass of transformers' model per prompt, over the prompt and
    # our output: its argmax at each position must be our next token. That holds exactly
    # when our output is its greedy continuation (what `generate` would give, token by
    # token, at 15x the time), EOS included.
    ours = _greedy(engine, prompts)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            logits = smollm2_reference(torch.tensor([prompt + got])).logits[0]
        theirs = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert got == theirs, f"first difference at output token {_first_difference(got, theirs)}"
    assert sum(len(g) for g in ours) >= len(prompts) * NEW_TOKENS // 2  # most ran long


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


def test_last_position_logits_match_transformers(smollm2_dir, prompts, smollm2_reference):
    ours_all = last_position_logits(smollm2_dir, prompts, max_model_len=1024)
    for prompt, ours in zip(prompts, ours_all, strict=True):
        with torch.inference_mode():
            expected = smollm2_reference(torch.tensor([prompt])).logits[0, -1]
        assert (ours - expected).abs().max().item() < 1e-3


def test_prompt_logprobs_match_transformers(engine, prompts, smollm2_reference):
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    for prompt in prompts[:3] + prompts[-1:]:  # plain, chat and the long prompt
        engine.add_request("prompt-logprobs", prompt, params)
        (out,) = [o for o in engine.step() if o.request_id == "prompt-logprobs"]
        with torch.inference_mode():
            expected = smollm2_reference(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        got = torch.tensor([lp.logprob for lp in out.prompt_logprobs])
        assert (got - expected[torch.arange(len(prompt) - 1), prompt[1:]]).abs().max() < 1e-3
        assert [lp.top[0][0] for lp in out.prompt_logprobs] == expected.argmax(-1).tolist()


def test_batch_and_chunked_prefill_match_single_requests(smollm2_dir, engine, prompts):
    sixteen = (prompts * 2)[:16]
    sixteen = [p[: 8 + 7 * i] if i >= len(prompts) else p for i, p in enumerate(sixteen)]
    alone = [_greedy(engine, [p], 32)[0] for p in sixteen]
    assert _greedy(engine, sixteen, 32) == alone
    chunked = LLMEngine(
        EngineConfig(
            model=str(smollm2_dir), num_threads=2, max_num_batched_tokens=48, max_num_seqs=48
        )
    )
    assert _greedy(chunked, sixteen, 32) == alone


def test_preemption_keeps_outputs_and_frees_every_block(smollm2_dir, engine, prompts):
    six = prompts[:6]
    alone = [_greedy(engine, [p], 32)[0] for p in six]
    # 10 blocks of 16 tokens cannot hold six ~45-token sequences at once.
    small = LLMEngine(EngineConfig(model=str(smollm2_dir), num_threads=2, num_kv_blocks=10))
    assert _greedy(small, six, 32) == alone
    stats = small.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_tp3_greedy_tokens_match_tp1(ray_cluster, smollm2_dir, engine, prompts):
    # Ten prompts in one continuously batched run, on three Ray worker ranks.
    ten = prompts[:10]
    tp3 = LLMEngine(EngineConfig(model=str(smollm2_dir), tensor_parallel_size=3))
    try:
        assert _greedy(tp3, ten, 32) == _greedy(engine, ten, 32)
        assert tp3.stats().num_free_blocks == tp3.stats().num_total_blocks
    finally:
        tp3.shutdown()


def test_bfloat16_errs_about_as_much_as_transformers_own_bfloat16(
    smollm2_dir, prompts, smollm2_reference
):
    # bf16 is the CPU fast path where AMX or AVX512-BF16 exist (and the CUDA default).
    # Cast from the float32 reference: what loading the GGUF at bfloat16 gives, without
    # dequantizing it again.
    theirs16 = copy.deepcopy(smollm2_reference).to(torch.bfloat16)
    ours_all = last_position_logits(smollm2_dir, prompts, 1024, torch.bfloat16)
    ours_err, theirs_err, same_top = 0.0, 0.0, 0
    for prompt, ours in zip(prompts, ours_all, strict=True):
        with torch.inference_mode():
            expected = smollm2_reference(torch.tensor([prompt])).logits[0, -1]
            theirs = theirs16(torch.tensor([prompt])).logits[0, -1].float()
        ours_err += (ours - expected).abs().max().item()
        theirs_err += (theirs - expected).abs().max().item()
        same_top += int(ours.argmax() == expected.argmax())
    # Measured: ours 0.39, transformers' 0.43 on average (logits of order 10-20).
    assert ours_err <= 1.5 * theirs_err
    assert same_top >= len(prompts) - 1


def test_bfloat16_engine_starts_like_float32_and_frees_every_block(smollm2_dir, engine, prompts):
    bf16 = LLMEngine(EngineConfig(model=str(smollm2_dir), num_threads=2, dtype="bfloat16"))
    got = _greedy(bf16, prompts, 4)
    expected = _greedy(engine, prompts, 4)
    assert sum(g[0] == e[0] for g, e in zip(got, expected, strict=True)) >= len(prompts) - 1
    stats = bf16.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
