"""The engine on the real Gemma 3 270M (the bundled gemma3-270m) against transformers.

transformers loads the same Q4_K_M GGUF itself (its own dequantization and config), so
agreement here checks the converter, the tokenizer, the Gemma 3 model (sliding and full
layers, past the 512-token window) and the engine together.
"""

from __future__ import annotations

import pytest
import torch
from fidelity_helpers import PLAIN, last_position_logits

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
HISTORY = (
    "The history of computing is a story of people and machines. Charles Babbage designed "
    "the Analytical Engine in the 1830s, and Ada Lovelace wrote what many call the first "
    "program for it. A century later, Alan Turing described a universal machine, and during "
    "the Second World War, engineers built electronic computers to break codes. "
)
RECIPE = (
    "Step {n}: whisk {n} eggs with a cup of milk, fold in flour until smooth, rest the batter "
    "for {n} minutes, then cook thin pancakes in a hot buttered pan. "
)
LONG = [
    HISTORY * 18 + "In summary, the most important idea in this history is",
    "".join(RECIPE.format(n=n) for n in range(1, 40)) + "The last step is",
]


@pytest.fixture(scope="module")
def engine(gemma3_dir):
    return LLMEngine(EngineConfig(model=str(gemma3_dir), num_threads=2))


@pytest.fixture(scope="module")
def prompts(engine):
    ids = [engine.tokenizer.encode(p) for p in PLAIN + LONG]
    assert all(len(p) > 1000 for p in ids[-2:]), [len(p) for p in ids[-2:]]
    assert all(p[0] == 2 for p in ids)  # BOS, which Gemma needs
    return ids


def _greedy(engine, prompts, max_tokens=NEW_TOKENS):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [s.output_token_ids for s in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def greedy(engine, prompts):
    """The engine's greedy continuation of each prompt."""
    return _greedy(engine, prompts)


@pytest.fixture(scope="module")
def reference_logits(prompts, greedy, gemma3_reference):
    """transformers' logits over each prompt and the engine's continuation, one forward
    pass each (shared: on 2 cores the long prompts' passes take most of a test)."""
    with torch.inference_mode():
        return [
            gemma3_reference(torch.tensor([p + g])).logits[0]
            for p, g in zip(prompts, greedy, strict=True)
        ]


def test_tokenizer_matches_transformers(engine, gemma3_dir):
    from transformers import AutoTokenizer

    from workers.model.bundled_model import bundled_model
    from workers.model.model_cache import ensure_gguf

    gguf = ensure_gguf(bundled_model("gemma3-270m"))
    theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for text in [*PLAIN, *LONG, "  two  spaces\tand\ttabs\n\n", "<start_of_turn>user\nhi"]:
        assert engine.tokenizer.encode(text) == theirs(text).input_ids, text


def test_greedy_tokens_match_transformers(prompts, greedy, reference_logits):
    # Checked in one forward pass of transformers' model over the prompt and our output:
    # its argmax at each position must be our next token, which holds exactly when our
    # output is its greedy continuation.
    for prompt, got, logits in zip(prompts, greedy, reference_logits, strict=True):
        theirs = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert got == theirs, (len(prompt), got, theirs)
    assert sum(len(g) for g in greedy) >= len(prompts) * NEW_TOKENS // 2  # most ran long


def test_last_position_logits_match_transformers(gemma3_dir, prompts, reference_logits):
    ours_all = last_position_logits(gemma3_dir, prompts, max_model_len=2048)
    for prompt, ours, logits in zip(prompts, ours_all, reference_logits, strict=True):
        expected = logits[len(prompt) - 1]
        assert (ours - expected).abs().max().item() < 2e-3 * expected.abs().max().item()


def test_prefix_hit_and_chunked_prefill_match_a_whole_miss(engine, gemma3_dir, prompts, greedy):
    # `greedy` computed the long prompt whole (a miss) in `engine`, batched with the rest.
    long_prompt, miss = prompts[-2], greedy[-2]
    hits = engine.stats().prefix_cache_hits
    # The same prompt again: every full block of it but the last is a hit.
    assert _greedy(engine, [long_prompt])[0] == miss
    assert engine.stats().prefix_cache_hits - hits >= len(long_prompt) - 2 * 16
    chunked = LLMEngine(
        EngineConfig(model=str(gemma3_dir), num_threads=2, max_num_batched_tokens=96)
    )
    assert _greedy(chunked, [long_prompt])[0] == miss
    for e in (engine, chunked):
        stats = e.stats()
        assert stats.num_free_blocks == stats.num_total_blocks


def test_baton_generate_local_gemma3(gemma3_dir, engine, capsys):
    from serve_app.ops.cli import main

    args = ["generate", "--local", "--model", "gemma3-270m", "--temperature", "0"]
    assert main([*args, "--max-tokens", "16", PLAIN[0]]) == 0
    expected = engine.tokenizer.decode(_greedy(engine, [engine.tokenizer.encode(PLAIN[0])], 16)[0])
    assert capsys.readouterr().out == expected + "\n"
