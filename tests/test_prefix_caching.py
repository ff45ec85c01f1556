"""Prefix caching through the whole engine: reuse, fidelity, isolation, eviction, release.

Fast tests run a small random-weight Llama; the fidelity test at the end runs the real
SmolLM2-135M-Instruct and is marked slow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from tiny_model import make_tiny_model

from workers.engine.block_hash import BlockHash, hash_full_blocks, root_hash
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)


class EventLog:
    """Collects the engine's KV events; `check` tells whether each batch is well formed.

    The engine catches and logs whatever its event callback raises, so `__call__` only
    records: an assertion there could never fail a test. Tests call `check` instead.
    """

    def __init__(self) -> None:
        self.batches: list[tuple[list[BlockHash], list[BlockHash]]] = []

    def __call__(self, stored: list[BlockHash], evicted: list[BlockHash]) -> None:
        self.batches.append((list(stored), list(evicted)))

    def check(self) -> None:
        """Every batch is non-empty and never both stores and evicts one hash."""
        for i, (stored, evicted) in enumerate(self.batches):
            assert stored or evicted, f"batch {i} is empty"
            both = set(stored) & set(evicted)
            assert not both, f"batch {i} both stores and evicts {both}"

    @property
    def evicted(self) -> list[BlockHash]:
        return [h for _, e in self.batches for h in e]

    def held(self) -> set[BlockHash]:
        """What a subscriber replaying the batches believes the engine holds."""
        held: set[BlockHash] = set()
        for stored, evicted in self.batches:
            assert not set(stored) & held, "a hash was stored twice without an eviction"
            assert set(evicted) <= held, "a hash was evicted that was never stored"
            held = (held - set(evicted)) | set(stored)
        return held


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = -1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _engine(model_dir, events: EventLog | None = None, **overrides) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), **{"num_kv_blocks": 64, **overrides})
    return LLMEngine(config, on_kv_events=events)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (n,), generator=g).tolist()


def _drain(engine: LLMEngine, results: dict[str, Result]) -> None:
    while engine.has_unfinished():
        for out in engine.step():
            r = results.setdefault(out.request_id, Result())
            r.tokens += out.new_token_ids
            r.logprobs += [lp.logprob for lp in out.new_logprobs]
            r.num_cached_tokens = out.num_cached_tokens


def _run(engine: LLMEngine, prompt: list[int], salt: str | None = None, params=GREEDY) -> Result:
    """Runs one request to completion on its own."""
    rid = f"r{engine.stats().num_steps}-{len(prompt)}-{salt}"
    engine.add_request(rid, prompt, params, cache_salt=salt)
    results: dict[str, Result] = {}
    _drain(engine, results)
    return results[rid]


def _assert_same_generation(hit: Result, cold: Result) -> None:
    assert hit.tokens == cold.tokens
    assert hit.logprobs == pytest.approx(cold.logprobs, abs=1e-4)


def _assert_all_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert all(engine.kv.pool.ref_count(b) == 0 for b in range(stats.num_total_blocks))


SYSTEM = _tokens(3 * BLOCK + 5, seed=10)  # three full blocks and a bit


def test_a_hit_computes_only_the_rest_and_generates_the_same_tokens(model_dir):
    cold_engine = _engine(model_dir, enable_prefix_caching=False)
    engine = _engine(model_dir)
    for i, user in enumerate([_tokens(7, 1), _tokens(30, 2), _tokens(16, 3)]):
        prompt = SYSTEM + user
        cold = _run(cold_engine, prompt)
        hit = _run(engine, prompt)
        assert cold.num_cached_tokens == 0
        # The first request warms the cache; later ones reuse the system prompt's blocks.
        assert hit.num_cached_tokens == (0 if i == 0 else 3 * BLOCK)
        _assert_same_generation(hit, cold)
    _assert_all_free(engine)


@pytest.mark.parametrize("length", [BLOCK, 2 * BLOCK, 2 * BLOCK + 1, 2 * BLOCK - 1])
def test_a_repeated_prompt_still_computes_its_last_token(model_dir, length):
    prompt = _tokens(length, seed=4)
    engine = _engine(model_dir)
    first = _run(engine, prompt)
    again = _run(engine, prompt)
    # Full blocks are reused, except that the one holding the last token is recomputed.
    assert again.num_cached_tokens == ((length - 1) // BLOCK) * BLOCK
    _assert_same_generation(again, first)


def test_a_hit_with_chunked_prefill_and_a_batch_matches_cold_runs(model_dir):
    prompts = [SYSTEM + _tokens(5 + 9 * i, seed=20 + i) for i in range(4)]
    cold = [_run(_engine(model_dir, enable_prefix_caching=False), p) for p in prompts]
    engine = _engine(model_dir, max_num_batched_tokens=20, max_num_seqs=4)
    _run(engine, SYSTEM)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, GREEDY)
    results: dict[str, Result] = {}
    _drain(engine, results)
    for i in range(4):
        assert results[f"b{i}"].num_cached_tokens == 3 * BLOCK
        _assert_same_generation(results[f"b{i}"], cold[i])
    _assert_all_free(engine)


def test_generated_tokens_are_cached_for_the_next_turn(model_dir):
    engine = _engine(model_dir)
    prompt = _tokens(BLOCK + 3, seed=5)
    first = _run(engine, prompt, params=SamplingParams(max_tokens=40, temperature=0.0))
    follow_up = prompt + first.tokens + _tokens(4, seed=6)
    # The K/V of generated tokens was written by the decode steps: all full blocks hit.
    written = len(prompt) + len(first.tokens) - 1
    again = _run(engine, follow_up)
    assert again.num_cached_tokens == (written // BLOCK) * BLOCK
    assert again.num_cached_tokens > len(prompt)
    cold = _run(_engine(model_dir, enable_prefix_caching=False), follow_up)
    _assert_same_generation(again, cold)


def test_different_salts_never_share_blocks(model_dir):
    engine = _engine(model_dir)
    prompt = SYSTEM + _tokens(8, seed=7)
    _run(engine, prompt, salt="tenant-a")
    assert _run(engine, prompt, salt="tenant-b").num_cached_tokens == 0
    assert _run(engine, prompt, salt=None).num_cached_tokens == 0
    assert _run(engine, prompt, salt="tenant-a").num_cached_tokens == 3 * BLOCK
    assert _run(engine, prompt, salt="tenant-b").num_cached_tokens == 3 * BLOCK


def test_stored_events_carry_the_routers_hashes(model_dir):
    events = EventLog()
    engine = _engine(model_dir, events, model_id="tiny-llama")
    prompt = SYSTEM + _tokens(20, seed=8)
    _run(engine, prompt, salt="t", params=SamplingParams(max_tokens=1))
    # What a router computes from the prompt alone, with the shared hash function.
    expected = hash_full_blocks(prompt, BLOCK, root_hash("tiny-llama", "t"))
    assert len(expected) == 4
    assert events.held() == set(expected)
    assert len(events.batches) == 1  # one batch for the step that computed them
    events.check()


def test_least_recently_used_blocks_are_evicted_first_and_the_pool_ends_free(model_dir):
    events = EventLog()
    # 12 blocks: room for three finished 4-block prompts, then eviction must start.
    engine = _engine(model_dir, events, num_kv_blocks=12)
    once = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = {name: _tokens(4 * BLOCK, seed=30 + i) for i, name in enumerate("abcd")}
    hashes = {
        name: hash_full_blocks(p, BLOCK, root_hash(engine.kv.model_id, None))
        for name, p in prompts.items()
    }
    for name in "abc":
        _run(engine, prompts[name], params=once)
    assert events.held() == set(hashes["a"] + hashes["b"] + hashes["c"])
    assert events.evicted == []
    # Reusing a makes it recently used; b is now the oldest.
    assert _run(engine, prompts["a"], params=once).num_cached_tokens == 3 * BLOCK
    # d needs 4 blocks with none empty: b's go, tail first, and nothing of a or c.
    _run(engine, prompts["d"], params=once)
    assert events.evicted == hashes["b"][::-1]
    assert events.held() == set(hashes["a"] + hashes["c"] + hashes["d"])
    assert _run(engine, prompts["c"], params=once).num_cached_tokens == 3 * BLOCK
    assert _run(engine, prompts["b"], params=once).num_cached_tokens == 0
    _assert_all_free(engine)
    assert engine.kv.pool.num_cached == len(events.held())
    events.check()


def test_blocks_in_use_are_never_evicted(model_dir):
    events = EventLog()
    engine = _engine(model_dir, events, num_kv_blocks=10)
    long_prompt = _tokens(3 * BLOCK, seed=40)
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    results: dict[str, Result] = {"long": Result(engine.step()[0].new_token_ids)}
    # Prefilled: its three blocks are cached, and held until it finishes.
    held_hashes = set(hash_full_blocks(long_prompt, BLOCK, root_hash(engine.kv.model_id, None)))
    # Many short requests churn the remaining blocks while "long" decodes.
    for i in range(12):
        engine.add_request(f"s{i}", _tokens(2 * BLOCK, seed=50 + i), SamplingParams(max_tokens=2))
        for out in engine.step():
            results.setdefault(out.request_id, Result()).tokens += out.new_token_ids
        running = engine.scheduler.running
        for seq in running:
            assert all(engine.kv.pool.ref_count(b) >= 1 for b in seq.block_tables[0])
    _drain(engine, results)
    assert events.evicted, "the workload was meant to force evictions"
    assert not held_hashes & set(events.evicted)
    assert engine.stats().num_preemptions == 0
    assert len(results["long"].tokens) == 60
    _assert_all_free(engine)
    events.check()


def test_abort_releases_shared_blocks_and_the_other_request_is_unaffected(model_dir):
    prompt = SYSTEM + _tokens(6, seed=60)
    expected = _run(_engine(model_dir, enable_prefix_caching=False), prompt)
    engine = _engine(model_dir)
    _run(engine, SYSTEM)
    engine.add_request("keep", prompt, GREEDY)
    engine.add_request("drop", SYSTEM + _tokens(9, seed=61), GREEDY)
    results: dict[str, Result] = {}
    for out in engine.step():
        results.setdefault(out.request_id, Result()).tokens += out.new_token_ids
        results[out.request_id].logprobs += [lp.logprob for lp in out.new_logprobs]
    shared = engine.scheduler.running[0].block_tables[0][:3]
    assert engine.scheduler.running[1].block_tables[0][:3] == shared
    assert [engine.kv.pool.ref_count(b) for b in shared] == [2, 2, 2]
    assert engine.abort("drop")
    assert [engine.kv.pool.ref_count(b) for b in shared] == [1, 1, 1]
    _drain(engine, results)
    _assert_same_generation(results["keep"], expected)
    _assert_all_free(engine)


def test_preemption_with_shared_prefixes_keeps_outputs_and_frees_everything(model_dir):
    prompts = [SYSTEM + _tokens(4 + 5 * i, seed=70 + i) for i in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    cold = _engine(model_dir, enable_prefix_caching=False)
    alone = [_run(cold, p, params=params).tokens for p in prompts]
    engine = _engine(model_dir, num_kv_blocks=14)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    results: dict[str, Result] = {}
    _drain(engine, results)
    assert [results[f"p{i}"].tokens for i in range(6)] == alone
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    _assert_all_free(engine)


def test_stats_count_queried_and_hit_tokens(model_dir):
    engine = _engine(model_dir)
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    assert stats.prefix_cache_hit_rate == 0.0
    a = SYSTEM + _tokens(10, seed=80)
    b = SYSTEM + _tokens(11, seed=81)
    _run(engine, a)
    _run(engine, b)
    stats = engine.stats()
    assert stats.prefix_cache_queries == len(a) + len(b)
    assert stats.prefix_cache_hits == 3 * BLOCK
    assert stats.prefix_cache_hit_rate == pytest.approx(3 * BLOCK / (len(a) + len(b)))


def test_caching_off_reports_nothing_and_shares_nothing(model_dir):
    events = EventLog()
    engine = _engine(model_dir, events, enable_prefix_caching=False)
    _run(engine, SYSTEM + [5])
    assert _run(engine, SYSTEM + [6]).num_cached_tokens == 0
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    assert events.batches == []
    events.check()


def test_bad_cache_salt_is_refused(model_dir):
    engine = _engine(model_dir)
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("r", [5, 6], GREEDY, cache_salt=7)
    with pytest.raises(ValueError, match="cache_salt: not valid Unicode"):  # a lone surrogate
        engine.add_request("r", [5, 6], GREEDY, cache_salt="\ud800")
    assert engine.stats().num_waiting == 0
    with pytest.raises(ValueError, match="model_id"):
        EngineConfig(model=str(model_dir), model_id="")


# -- the real model ----------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_cache_hits_generate_the_same_tokens_as_a_cold_cache(smollm2_dir):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), num_threads=2))
    tok = engine.tokenizer
    system = (
        "You are Baton, a careful assistant for a library. Answer in plain English, cite "
        "the shelf code of every book you mention, never invent a title, and keep answers "
        "under five sentences unless the reader asks for more detail. "
    ) * 2
    turns = [
        "Which books about volcanoes do you have?",
        "Can you recommend a novel set in Lisbon?",
        "How do I renew a loan online?",
    ]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    prompts = [
        tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": turn}])
        for turn in turns
    ]
    shared = next(i for i, t in enumerate(zip(*prompts, strict=False)) if len(set(t)) > 1)
    assert shared >= 4 * BLOCK, "the system prompt should span several blocks"
    for i, prompt in enumerate(prompts):
        # A salt of its own makes a cold cache; the common salt finds the earlier turns.
        cold = _run(engine, prompt, salt=f"cold-{i}", params=params)
        hit = _run(engine, prompt, salt="shared", params=params)
        assert cold.num_cached_tokens == 0
        if i:
            assert hit.num_cached_tokens == (shared // BLOCK) * BLOCK
        assert hit.tokens == cold.tokens
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 2 * (shared // BLOCK) * BLOCK
    _assert_all_free(engine)


def test_a_failing_event_callback_does_not_break_generation(model_dir):
    calls = []

    def broken(stored, evicted):
        calls.append((stored, evicted))
        raise ConnectionError("registry unreachable")

    config = EngineConfig(model=str(model_dir), num_kv_blocks=64)
    engine = LLMEngine(config, on_kv_events=broken)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (seq,) = engine.generate([_tokens(40, seed=9)], params)
    assert len(seq.output_token_ids) == 8
    assert calls, "the callback never ran, so its failure was never exercised"
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
