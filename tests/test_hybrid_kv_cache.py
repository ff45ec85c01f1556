"""The hybrid KV cache through the engine, on small random-weight Gemma 3 models: what a
long sequence holds of the pool, the context it allows, and a KV handoff that moves only
what decode needs."""

from __future__ import annotations

import pytest
from handoff_helpers import GREEDY, _assert_all_free, _drain, _handoff, _single, _tokens, _tokens_of
from tiny_gemma3 import make_tiny_gemma3

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def gemma_270m_shape(tmp_path_factory):
    """Gemma 3 270M's layer pattern and window (18 layers, every 6th full, 512) in a
    model small enough to prefill 8k tokens quickly."""
    return make_tiny_gemma3(
        tmp_path_factory.mktemp("g270"),
        hidden_size=32,
        num_layers=18,
        num_heads=1,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=32,
        sliding_window=512,
        sliding_window_pattern=6,
        max_position_embeddings=32768,
    )


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """2 sliding layers to 1 full, window 20 (over a block): prompts of a few blocks."""
    return make_tiny_gemma3(tmp_path_factory.mktemp("w20"), sliding_window=20)


def test_an_8k_sequence_holds_under_a_quarter_of_an_all_full_allocation(gemma_270m_shape):
    engine = LLMEngine(
        EngineConfig(model=str(gemma_270m_shape), num_kv_blocks=1024, max_num_batched_tokens=1024)
    )
    groups = engine.kv.groups
    assert (groups.num_groups, groups.group_size) == (6, 3)
    # Every layer full would need a block per group per 16 tokens: 3,072 for 8k, three
    # times this pool; the context the pool allows counts the windows instead.
    assert engine.max_model_len > 8192 + 64
    engine.add_request(
        "long", _tokens(8192, seed=1), SamplingParams(max_tokens=64, ignore_eos=True)
    )
    held = []
    while engine.has_unfinished():
        engine.step()
        seq = engine.scheduler.running[0] if engine.scheduler.running else None
        if seq is not None and seq.num_computed_tokens >= 8192:
            all_full = groups.num_groups * engine.kv.blocks_for_tokens(seq.num_computed_tokens)
            used = engine.kv.num_blocks - engine.kv.num_free_blocks
            held.append(used / all_full)
    assert len(held) == 63 and max(held) <= 0.25
    # While it ran, its sliding groups' blocks behind the window went back to the pool.
    assert engine.stats().num_preemptions == 0
    _assert_all_free(engine)


def test_a_long_running_sequence_s_sliding_blocks_return_to_the_pool(windowed):
    engine = LLMEngine(EngineConfig(model=str(windowed), num_kv_blocks=64))
    engine.add_request("r", _tokens(10, seed=2), SamplingParams(max_tokens=200, ignore_eos=True))
    seen = []
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            seen.append(engine.kv.num_held_blocks(seq) - len(seq.block_tables[2]))
    # Two sliding groups keep the window's 2-3 blocks each, at every length up to 210.
    assert max(seen) <= 2 * 3
    _assert_all_free(engine)


@pytest.mark.parametrize("n", [5, BLOCK, BLOCK + 1, 3 * BLOCK + 7, 6 * BLOCK])
def test_a_handoff_moves_only_the_window_of_sliding_layers(windowed, n):
    single = LLMEngine(EngineConfig(model=str(windowed), num_kv_blocks=64))
    prefill = LLMEngine(EngineConfig(model=str(windowed), num_kv_blocks=64))
    decode = LLMEngine(EngineConfig(model=str(windowed), num_kv_blocks=64))
    prompt = _tokens(n, seed=n)
    assert _tokens_of(_handoff(prefill, decode, "r", prompt)) == _tokens_of(_single(single, prompt))
    blocks = -(-n // BLOCK)
    # The next query (position n) reads keys n - 19 .. n, per sliding group.
    window = blocks - max(0, n - 19) // BLOCK
    stats = prefill.stats()
    assert stats.kv_blocks_exported == blocks + 2 * window
    assert stats.kv_blocks_exported_all_layers == 3 * blocks
    assert decode.stats().kv_blocks_imported == stats.kv_blocks_exported
    _assert_all_free(prefill, decode)


def test_decode_takes_only_what_it_lacks_of_an_export_that_skipped_less(windowed):
    """Decode cached more of the prompt after prefill exported: it imports a suffix of
    each group's blocks from the export, and the output is unchanged."""
    single = LLMEngine(EngineConfig(model=str(windowed), num_kv_blocks=64))
    prefill = LLMEngine(EngineConfig(model=str(windowed), num_kv_blocks=64))
    decode = LLMEngine(EngineConfig(model=str(windowed), num_kv_blocks=64))
    system = _tokens(4 * BLOCK, seed=7)
    prompt = system + _tokens(2 * BLOCK + 3, seed=8)
    prefill.add_request("b", prompt, GREEDY, prefill_only=True)
    _drain(prefill)
    handle, parts = prefill.export_kv("b", skip_blocks=0)  # decode held nothing yet
    # Meanwhile decode computed the system prompt itself.
    _single(decode, system + _tokens(5, seed=9))
    assert decode.cached_prefix_blocks(list(handle.block_hashes), prompt) == 4
    imported = decode.stats().kv_blocks_imported
    decode.add_prefilled_request("b", prompt, GREEDY, handle, parts)
    assert prefill.release_handoff("b")
    rest = _drain(decode)["b"]
    expected = _single(single, prompt)
    assert _tokens_of(rest) == _tokens_of(expected)
    # 7 blocks: the full group's 3 past the 4 held, and each sliding group its window's 2.
    assert decode.stats().kv_blocks_imported - imported == 3 + 2 * 2
    _assert_all_free(prefill, decode)
