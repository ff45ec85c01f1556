"""Gemma 3 GGUF files converted to Hugging Face folders, checked against transformers.

A tiny random Gemma 3 is written as llama.cpp writes one (tiny_gemma3_gguf.py), converted,
and held to transformers' own GGUF loader: the same weights (norms back to w from 1 + w),
a config transformers reads into the same model, and the same tokenizer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tiny_gemma3 import make_tiny_gemma3
from tiny_gemma3_gguf import vocabulary, write_gemma3_gguf

from workers.model.config import ModelConfig
from workers.model.gguf_import import convert_gguf
from workers.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    """(source transformers model, GGUF path, expected HF weights, converted folder)."""
    from transformers import Gemma3ForCausalLM

    root = tmp_path_factory.mktemp("g3gguf")
    source = Gemma3ForCausalLM.from_pretrained(
        make_tiny_gemma3(
            root / "hf",
            num_layers=4,
            sliding_window_pattern=2,
            num_kv_heads=1,
            query_pre_attn_scalar=16,
            sliding_window=6,
        )
    ).eval()
    path = root / "tiny-gemma3.gguf"
    expected = write_gemma3_gguf(source, path)
    return source, path, expected, convert_gguf(path, root / "converted")


def test_weights_are_the_checkpoints(gemma3_gguf):
    _, _, expected, out = gemma3_gguf
    with safe_open(str(out / "model.safetensors"), "np") as f:
        got = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_config_is_read_as_gemma3(gemma3_gguf):
    source, _, _, out = gemma3_gguf
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForCausalLM"]
    cfg = ModelConfig.from_pretrained(out)
    assert cfg.family == "gemma3"
    # Every sixth layer is full in llama.cpp's Gemma 3 (the file does not say); the
    # source's own pattern differs, which the converter cannot know.
    assert cfg.layer_types == ("sliding_attention",) * 4
    assert cfg.sliding_window == 6
    assert cfg.local_rope_theta == 10_000.0 and cfg.rope_theta == 1_000_000.0
    assert cfg.attention_scale == pytest.approx(source.config.head_dim**-0.5)
    assert cfg.tie_word_embeddings and cfg.bos_token_id == 2


def test_transformers_reads_the_folder_as_its_own_gguf_loader_reads_the_file(gemma3_gguf):
    """The converted folder and transformers' direct load of the file are one model."""
    from transformers import AutoModelForCausalLM

    _, path, _, out = gemma3_gguf
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # transformers' GGUF loader leaves query_pre_attn_scalar at its default (256, Gemma 3
    # 270M's head_dim); llama.cpp, and so the converter, take the file's head_dim.
    theirs = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, query_pre_attn_scalar=16
    ).eval()
    ids = torch.tensor([[2, *range(10, 40)]])
    with torch.inference_mode():
        np.testing.assert_allclose(
            ours(ids).logits.numpy(), theirs(ids).logits.numpy(), rtol=1e-4, atol=1e-4
        )


TEXTS = [
    "abc ab a b c",
    "  abc   ab  ",
    "a\n\nb\tc",
    "xyz unknown bytes é 東",
    "<bos>abc<eos>",
    "",
]


def test_tokenizer_matches_transformers(gemma3_gguf):
    from transformers import AutoTokenizer

    _, path, _, out = gemma3_gguf
    ours = Tokenizer(out)
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ids[:1] == [2]  # BOS, as the file asks
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    # Runs of spaces, written with real spaces in the file, keep their ids under the
    # vocabulary's "▁" spelling (and get no second id as added tokens).
    assert ours.token_id("▁▁") == vocabulary(320).index("  ")
    assert ours.hf.encode("  ", add_special_tokens=False).ids == [vocabulary(320).index("  ")]
    assert ours.vocab_size == 320
