"""Gemma 3 (text) against transformers' own Gemma3ForCausalLM on random-weight
checkpoints: prompt logits, greedy output through the engine (alone, batched, chunked,
after a prefix-cache hit), sliding-window attention over the paged cache, the GeGLU
kernel, and the config it reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from arch_checks import assert_batched_chunked_and_cached_match_alone
from test_llama import _prefill_logits
from tiny_gemma3 import make_tiny_gemma3
from tiny_model import random_prompts

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.model import kernels
from workers.model.attention import PagedAttention
from workers.model.attention_metadata import AttentionMetadata, PrefillChunk
from workers.model.config import SUPPORTED_MODEL_TYPES, ModelConfig
from workers.model.loader import load_model

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
FULL, SLIDING = "full_attention", "sliding_attention"

# Windows shorter than the prompts (1-89 tokens, blocks of 16), so sliding layers cut
# the context, mid-block and across blocks.
VARIANTS = {
    # 2 sliding : 1 full, window 4; 4 query heads on 2 KV heads, head_dim 16.
    "w4-2to1-gqa": {"sliding_window": 4, "sliding_window_pattern": 3, "num_layers": 3},
    # Gemma 3's 5 : 1, window 8; head_dim 64 (a compiled kernel width), MQA.
    "w8-5to1-d64": {
        "sliding_window": 8,
        "sliding_window_pattern": 6,
        "num_layers": 6,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 64,
    },
    # Full layers first and last, window 20 (over a block); linear rope scaling on full
    # layers and logit soft-capping, as larger Gemma 3 configs have; an LM head of its own.
    "w20-scaled-softcap-untied": {
        "sliding_window": 20,
        "layer_types": [FULL, SLIDING, SLIDING, FULL],
        "num_layers": 4,
        "num_kv_heads": 4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "final_logit_softcapping": 3.0,
        "tie_word_embeddings": False,
    },
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def gemma_dir(request, tmp_path_factory):
    return make_tiny_gemma3(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


@pytest.fixture(scope="module")
def reference(gemma_dir):
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"num_kv_blocks": 128, **overrides}))


def _outputs(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    return [s.output_token_ids for s in engine.generate(prompts, params)]


def _prompts() -> list[list[int]]:
    return [p for p in random_prompts(12, seed=5) if len(p) > 24][:4]


def test_prompt_logits_match_transformers(gemma_dir, reference):
    ours = load_model(gemma_dir)
    ids = torch.randint(3, 320, (70,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    assert (_prefill_logits(ours, ids) - expected).abs().max() < 1e-3


@pytest.mark.parametrize("kernels_on", [True, False], ids=["kernels", "torch-ops"])
def test_greedy_output_matches_transformers_generate(gemma_dir, reference, kernels_on, monkeypatch):
    if not kernels_on:  # the path of a machine without a compiler, and of CUDA
        monkeypatch.setattr(kernels, "library", lambda: None)
    engine = _engine(gemma_dir)
    for prompt in _prompts():
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        assert _outputs(engine, [prompt]) == [expected]


def test_batched_chunked_and_cached_runs_match_one_alone(gemma_dir):
    # Windows of 4-20 tokens: chunks of 8 attend to their cached context through them.
    assert_batched_chunked_and_cached_match_alone(gemma_dir, _prompts())


def _windowed_reference(q, k, v, positions, window, scale):
    """q [n, H, D] at `positions` of a context k/v [ctx, Hkv, D] -> [n, H * D], each
    query over the keys q - window < kv <= q."""
    kv = torch.arange(k.shape[0])
    ahead = positions[:, None] - kv[None, :]
    mask = (ahead >= 0) & (ahead < window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("path", ["kernel", "gathered"])
@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_a_sliding_layer_attends_to_exactly_its_window(path, window):
    if path == "kernel" and kernels.library() is None:
        pytest.skip("needs Baton's CPU kernels")
    heads, kv_heads, dim, block, num_blocks = 4, 2, 16, 4, 24
    gen = torch.Generator().manual_seed(window)
    attn = PagedAttention(heads, kv_heads, dim, scale=0.3, sliding_window=window)
    shape = (kv_heads, num_blocks * block, dim)
    attn.bind_cache(torch.zeros(shape), torch.zeros(shape))
    if path == "gathered":
        attn._kernel = None
    order = torch.randperm(num_blocks, generator=gen).tolist()
    # Two decodes (contexts 11 and 8), a fresh prefill of 9 and a chunk of 6 after 13.
    lengths, new = [11, 8, 9, 19], [1, 1, 9, 6]
    tables = [order[0:3], order[3:5], order[5:8], order[8:13]]

    def slots(table, start, stop):
        pos = torch.arange(start, stop)
        return torch.tensor(table)[pos // block] * block + pos % block

    k_all = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    v_all = [torch.randn(n, kv_heads, dim, generator=gen) for n in lengths]
    for table, n, m, k, v in zip(tables, lengths, new, k_all, v_all, strict=True):
        cached = slots(table, 0, n - m)
        attn.k_cache.index_copy_(1, cached, k[: n - m].transpose(0, 1))
        attn.v_cache.index_copy_(1, cached, v[: n - m].transpose(0, 1))
    q = torch.randn(sum(new), heads, dim, generator=gen)
    k = torch.cat([ka[n - m :] for ka, n, m in zip(k_all, lengths, new, strict=True)])
    v = torch.cat([va[n - m :] for va, n, m in zip(v_all, lengths, new, strict=True)])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(
            [slots(t, n - m, n) for t, n, m in zip(tables, lengths, new, strict=True)]
        ),
        block_size=block,
        num_decode=2,
        decode_tables=torch.tensor([tables[0], tables[1] + [0]]),
        decode_lengths=torch.tensor(lengths[:2]),
        prefills=[
            PrefillChunk(2, 9),
            PrefillChunk(11, 6, slots(tables[3], 0, lengths[3])),
        ],
    )
    out = attn(q, k, v, [meta])
    assert (attn._kernel is not None) == (path == "kernel")
    rows = [0, 1, 2, 11, 17]
    expected = torch.cat(
        [
            _windowed_reference(
                q[rows[i] : rows[i + 1]],
                k_all[i],
                v_all[i],
                torch.arange(lengths[i] - new[i], lengths[i]),
                window,
                0.3,
            )
            for i in range(4)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


GEMMA_BASE = {
    "model_type": "gemma3_text",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
}
LEFT_OUT = object()  # a key the config.json does not have


@pytest.mark.parametrize(
    "fields",
    [
        # transformers' defaults for everything else, a head_dim of 256 among them
        {"head_dim": LEFT_OUT, "num_key_value_heads": LEFT_OUT},
        # A Hub config from before transformers 5: a pattern, two bases, rope_scaling.
        {
            "sliding_window_pattern": 3,
            "rope_theta": 500000.0,
            "rope_local_base_freq": 20000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "sliding_window": 512,
            "query_pre_attn_scalar": 168,
        },
        {"layer_types": [FULL, SLIDING] * 3 + [SLIDING], "max_position_embeddings": 4096},
    ],
    ids=["defaults", "pre-v5-hub", "layer-types"],
)
def test_the_config_reads_as_transformers_reads_it(fields):
    from transformers import Gemma3TextConfig

    raw = {k: v for k, v in {**GEMMA_BASE, **fields}.items() if v is not LEFT_OUT}
    reference = Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    ours = ModelConfig.from_dict(raw)
    assert ours.family == "gemma3"
    assert (ours.head_dim, ours.num_key_value_heads) == (
        reference.head_dim,
        reference.num_key_value_heads,
    )
    assert (ours.bos_token_id, ours.eos_token_ids) == (reference.bos_token_id, (1,))
    assert ours.layer_types == tuple(reference.layer_types)
    assert ours.sliding_window == reference.sliding_window
    full, local = (reference.rope_parameters[t] for t in (FULL, SLIDING))
    assert (ours.rope_theta, ours.local_rope_theta) == (full["rope_theta"], local["rope_theta"])
    if full["rope_type"] == "linear":
        assert ours.rope_scaling.factor == full["factor"]
    else:
        assert ours.rope_scaling is None
    assert ours.attention_scale == reference.query_pre_attn_scalar**-0.5
    assert ours.tie_word_embeddings == reference.tie_word_embeddings
    assert ours.hidden_act == reference.hidden_activation
    # The whole context, not the window: sliding layers attend to exactly theirs.
    assert ours.max_position_embeddings == reference.max_position_embeddings
    windows = [ours.layer_window(i) for i in range(ours.num_hidden_layers)]
    assert windows == [
        reference.sliding_window if t == SLIDING else None for t in reference.layer_types
    ]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model_type": "gemma3"}, "text-only Gemma3ForCausalLM"),
        ({"model_type": "phi3"}, "model_type 'phi3' is not supported"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "type 'longrope'"),
        ({"layer_types": [FULL] * 3}, "each of the 7 layers"),
        ({"sliding_window": None}, "sliding_window=None"),
        (
            {"rope_parameters": {FULL: {"rope_type": "default", "partial_rotary_factor": 0.5}}},
            "partial_rotary_factor",
        ),
    ],
)
def test_what_baton_does_not_run_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message) as err:
        ModelConfig.from_dict({**GEMMA_BASE, **fields})
    if "model_type" in fields:
        for supported in SUPPORTED_MODEL_TYPES:
            assert supported in str(err.value)


def test_an_unsupported_model_folder_is_refused_at_load(tmp_path):
    model_dir = make_tiny_gemma3(tmp_path)
    config = (model_dir / "config.json").read_text()
    (model_dir / "config.json").write_text(config.replace('"gemma3_text"', '"phi3"'))
    with pytest.raises(ValueError, match="supported model types: llama, mistral, qwen2"):
        load_model(model_dir)


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_tensor_parallel_ranks_compute_the_single_rank_logits(tmp_path, num_kv_heads):
    import torch.multiprocessing as mp
    from tiny_gemma3 import tp_rank_prefill_logits

    # Two ranks of 2 query heads each, every projection sharded; with one KV head (as
    # Gemma 3 270M has) each rank holds it whole.
    model_dir = make_tiny_gemma3(
        tmp_path / "model", sliding_window=4, num_heads=4, num_kv_heads=num_kv_heads
    )
    ids = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(2))
    out = tmp_path / "logits.pt"
    args = (2, str(tmp_path / "init"), str(model_dir), ids.tolist(), str(out))
    mp.start_processes(tp_rank_prefill_logits, args, nprocs=2, start_method="spawn")
    single = _prefill_logits(load_model(model_dir), ids)
    torch.testing.assert_close(torch.load(out), single, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 7, 32, 80])
# 24: whole AVX2 vectors only (AVX2's form on either CPU); 12: not whole vectors, torch's ops
@pytest.mark.parametrize("half", [1536, 24, 12])
def test_gelu_tanh_mul_is_transformers_geglu_activation(vector_width, rows, half):
    from workers.model.mlp import gelu_tanh_mul

    gen = torch.Generator().manual_seed(rows * half)
    # Wide enough to reach both ends of the exponential's range.
    gate_up = torch.randn(rows, 2 * half, generator=gen) * 10
    gate, up = gate_up.double().chunk(2, dim=-1)
    # Against float64: torch's float32 gelu loses digits to 1 + tanh(u)'s cancellation
    # for negative gates, which the kernel's g / (1 + e^(-2u)) avoids.
    exact = F.gelu(gate, approximate="tanh") * up
    out = gelu_tanh_mul(gate_up)
    assert out.shape == (rows, half) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact, rtol=2e-6, atol=5e-6)
