"""What proving a ported architecture takes, shared by its tests: a small random-weight
model written by transformers itself, and checks of Baton's engine against transformers'
own implementation (prompt logits, greedy output) and against itself (batched, chunked,
from the prefix cache, across TP ranks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_llama import _prefill_logits
from tiny_model import random_prompts, save_folder

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model.loader import load_model

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def make_random_model(model_class, config, out_dir: Path, seed: int = 0) -> Path:
    """`model_class(config)` with weights large enough to make greedy choices decisive
    (default init gives near-uniform logits) and norms with weights of their own, saved
    as a Hugging Face folder with the byte tokenizer."""
    torch.manual_seed(seed)
    model = model_class(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 0.05)
    return save_folder(model, out_dir)


def reference_model(model_class, model_dir: Path):
    return model_class.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompts(n: int = 6, seed: int = 5, vocab_size: int = 320) -> list[list[int]]:
    """Random prompts of 25-89 tokens: over several blocks of 16."""
    return [p for p in random_prompts(4 * n, seed, vocab_size) if len(p) > 24][:n]


def assert_prompt_logits_match(model_dir: Path, reference, length: int = 70, tol=1e-3) -> None:
    ids = torch.randint(3, 320, (length,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = _prefill_logits(load_model(model_dir), ids)
    assert (got - expected).abs().max() < tol


def engine(model_dir: Path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 256, **overrides}))


def outputs(llm: LLMEngine, batch: list[list[int]]) -> list[list[int]]:
    return [s.output_token_ids for s in llm.generate(batch, GREEDY)]


def assert_greedy_matches(model_dir: Path, reference, batch: list[list[int]]) -> None:
    llm = engine(model_dir)
    for prompt in batch:
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        assert outputs(llm, [prompt]) == [expected]


def assert_batched_chunked_and_cached_match_alone(model_dir: Path, batch: list[list[int]]) -> None:
    alone = [outputs(engine(model_dir, enable_prefix_caching=False), [p])[0] for p in batch]
    # Decodes of different lengths share steps with each other and with prefills.
    assert outputs(engine(model_dir, enable_prefix_caching=False), batch) == alone
    # Prefill chunks of 8 attend to their cached context.
    assert outputs(engine(model_dir, max_num_batched_tokens=8, max_num_seqs=4), batch) == alone
    # Each prompt again: its full blocks come from the prefix cache.
    llm = engine(model_dir, num_kv_blocks=1024)
    outputs(llm, batch)
    for prompt, expected in zip(batch, alone, strict=True):
        llm.add_request("again", prompt, GREEDY)
        tokens, cached = [], 0
        while llm.has_unfinished():
            for out in llm.step():
                tokens += out.new_token_ids
                cached = out.num_cached_tokens
        assert cached == ((len(prompt) - 1) // 16) * 16 > 0
        assert tokens == expected


def assert_tp_ranks_match_one(tmp_path: Path, model_dir: Path, world: int = 2) -> None:
    """`world` ranks (gloo, one process each) compute the single rank's prompt logits."""
    import torch.multiprocessing as mp
    from tiny_gemma3 import tp_rank_prefill_logits

    ids = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = _prefill_logits(load_model(model_dir), torch.tensor(ids))
    out = tmp_path / "logits.pt"
    init = tmp_path / "init"
    mp.spawn(
        tp_rank_prefill_logits,
        args=(world, str(init), str(model_dir), ids, str(out)),
        nprocs=world,
        join=True,
    )
    torch.testing.assert_close(torch.load(out), expected, atol=1e-4, rtol=1e-4)


# A small model of each newly ported architecture, as its transformers classes write it.
_SHAPES = {
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "eos_token_id": 0,
    "bos_token_id": None,
    "pad_token_id": 0,
}
ARCHITECTURES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"intermediate_size": 128}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"intermediate_size": 128, "sliding_window": 20, "query_pre_attn_scalar": 64},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2},
    ),
}


def make_architecture(name: str, out_dir: Path) -> Path:
    """A random-weight model of architecture `name` (ARCHITECTURES) in `out_dir`."""
    import transformers

    config_class, model_class, fields = ARCHITECTURES[name]
    config = getattr(transformers, config_class)(**{**_SHAPES, **fields})
    return make_random_model(getattr(transformers, model_class), config, out_dir)


def architecture_fixtures(
    model_class: str, make_config: Callable[..., object], variants: dict[str, dict]
):
    """Module-scoped fixtures `model_dir` (a random-weight model of transformers'
    `model_class` per variant, its config `make_config(**variant)`) and `reference`
    (transformers' model loaded from it), for a test module to bind at its top level."""

    @pytest.fixture(scope="module", params=list(variants))
    def model_dir(request, tmp_path_factory):
        import transformers

        cls = getattr(transformers, model_class)
        config = make_config(**variants[request.param])
        return make_random_model(cls, config, tmp_path_factory.mktemp(request.param))

    @pytest.fixture(scope="module")
    def reference(model_dir):
        import transformers

        return reference_model(getattr(transformers, model_class), model_dir)

    return model_dir, reference


class ArchitectureConformance:
    """The checks every ported architecture passes, for a test class in a module that
    binds `architecture_fixtures`."""

    def test_prompt_logits_match_transformers(self, model_dir, reference):
        assert_prompt_logits_match(model_dir, reference, length=90)

    def test_greedy_output_matches_transformers(self, model_dir, reference):
        assert_greedy_matches(model_dir, reference, prompts(3))

    def test_batched_chunked_and_cached_runs_match_one_alone(self, model_dir):
        assert_batched_chunked_and_cached_match_alone(model_dir, prompts(4))

    def test_tensor_parallel_ranks_compute_the_single_rank_logits(self, model_dir, tmp_path):
        assert_tp_ranks_match_one(tmp_path, model_dir)
