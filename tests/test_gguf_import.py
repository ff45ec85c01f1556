"""GGUF -> Hugging Face folder conversion.

Fast tests use tiny synthetic GGUF files written the way llama.cpp writes them; the slow ones
check the real default model against transformers' own GGUF loader, an independent
implementation of the same dequantization, Q/K un-permutation and tokenizer reconstruction.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, llama_cpp_permute
from safetensors import safe_open
from tokenizers import Tokenizer

from workers.model import gguf_import
from workers.model.block_matmul import (
    BLOCK_KINDS_KEY,
    BLOCKS_FILE,
    WEIGHTS_DIGEST_KEY,
    BlockSource,
)
from workers.model.gguf_import import convert_gguf, unpermute_qk, write_blocks
from workers.model.loader import weights_digest


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path), "np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


# --- fast: synthetic files ------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute():
    n_head, head_dim, cols = 3, 8, 5
    hf = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    stored = llama_cpp_permute(hf, n_head)
    assert not np.array_equal(stored, hf)
    np.testing.assert_array_equal(unpermute_qk(stored, n_head), hf)
    # The meaning, spelled out: llama.cpp interleaves each head's rotate-half pairs, so HF row
    # (h, i) and its partner (h, i + d/2) sit at rows 2i and 2i + 1 of that head in the GGUF.
    for h in range(n_head):
        for i in range(head_dim // 2):
            base = h * head_dim
            np.testing.assert_array_equal(stored[base + 2 * i], hf[base + i])
            np.testing.assert_array_equal(stored[base + 2 * i + 1], hf[base + head_dim // 2 + i])


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_conversion_is_exact(tmp_path, make_tiny_gguf, tied):
    expected = make_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    assert out == tmp_path / "model"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "gguf_blocks",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    tensors = _load_safetensors(out / "model.safetensors")
    assert set(tensors) == set(expected)
    assert ("lm_head.weight" in tensors) == (not tied)
    for name, value in expected.items():
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == TINY["hidden"]
    assert config["intermediate_size"] == TINY["ffn"]
    assert config["num_hidden_layers"] == TINY["layers"]
    assert config["num_attention_heads"] == TINY["heads"]
    assert config["num_key_value_heads"] == TINY["kv_heads"]
    assert config["head_dim"] == TINY["hidden"] // TINY["heads"]
    assert config["max_position_embeddings"] == TINY["ctx"]
    assert config["rope_theta"] == 50000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["vocab_size"] == expected["model.embed_tokens.weight"].shape[0]
    assert config["tie_word_embeddings"] is tied
    assert "rope_scaling" not in config
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["torch_dtype"] == "float32"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_tiny_tokenizer(tmp_path, make_tiny_gguf):
    make_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = tok.get_vocab()
    enc = tok.encode("<|im_start|>hello world<|im_end|>")
    assert enc.tokens == ["<|im_start|>", "hello", "Ġw", "o", "r", "l", "d", "<|im_end|>"]
    assert enc.ids[0] == 1 and enc.ids[-1] == 2 and enc.ids[1] == vocab["hello"]
    # The 'smollm' pre-tokenizer isolates digits before the GPT-2 regex, so the spaces in
    # "  1" stay one piece (the GPT-2 regex alone would make it "Ġ", "Ġ1" -> Ġ, Ġ, 1).
    assert tok.encode("  1").tokens == ["ĠĠ", "1"]
    assert tok.encode(" 12").tokens == ["Ġ", "1", "2"]
    text = "hello  wörld 12\n\t🙂"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text

    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == "{{ messages[0]['content'] }}"
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_config["add_bos_token"] is False


def test_llama3_family_tokenizer_follows_llama_cpp(tmp_path, make_tiny_gguf):
    # No add_bos_token key: llama.cpp adds BOS for this family, and matches whole words first.
    make_tiny_gguf(
        tmp_path / "tiny.gguf",
        overrides={"tokenizer.ggml.pre": "llama-bpe"},
        skip_keys=["tokenizer.ggml.add_bos_token"],
    )
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("hello world").tokens == ["<|im_start|>", "hello", "Ġw", "o", "r", "l", "d"]
    assert tok.encode("hello", add_special_tokens=False).tokens == ["hello"]
    assert json.loads(tok.to_str())["model"]["ignore_merges"] is True
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_non_llama_architecture_raises(tmp_path, make_tiny_gguf):
    make_tiny_gguf(tmp_path / "bad.gguf", arch="mamba")
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_missing_metadata_key_raises(tmp_path, make_tiny_gguf):
    make_tiny_gguf(tmp_path / "bad.gguf", skip_keys=["llama.block_count"])
    with pytest.raises(ValueError, match="llama.block_count"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "model")


def test_unknown_tensor_raises(tmp_path, make_tiny_gguf):
    bias = np.zeros(TINY["hidden"], dtype=np.float32)
    make_tiny_gguf(tmp_path / "bad.gguf", extra_tensors={"blk.0.attn_q.bias": bias})
    with pytest.raises(ValueError, match="blk.0.attn_q.bias"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "model")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"skip_keys": ["tokenizer.ggml.pre"]}, "'tokenizer.ggml.pre' is missing"),
        ({"overrides": {"tokenizer.ggml.pre": "qwen2"}}, "unsupported tokenizer.ggml.pre 'qwen2'"),
        ({"overrides": {"tokenizer.ggml.model": "t5"}}, "tokenizer model 't5'"),
    ],
)
def test_unsupported_tokenizer_raises(tmp_path, make_tiny_gguf, change, message):
    # Guessing a split would tokenize most text right and some wrong; refusing is safer.
    make_tiny_gguf(tmp_path / "bad.gguf", **change)
    with pytest.raises(ValueError, match=message):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "model")


def test_existing_output_is_not_overwritten(tmp_path, make_tiny_gguf):
    make_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep").write_text("mine")
    with pytest.raises(FileExistsError):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    assert (tmp_path / "model" / "keep").read_text() == "mine"


@pytest.mark.parametrize("tied", [True, False])
def test_quantized_tensors_keep_their_blocks(tmp_path, make_tiny_gguf, tied):
    expected = make_tiny_gguf(tmp_path / "tiny.gguf", tied=tied, quantized=True)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    with safe_open(str(out / BLOCKS_FILE), "pt") as f:
        kinds = dict(f.metadata())
        assert kinds.pop("format") == "pt"
        # Written for these weights (the loader ignores blocks of replaced ones).
        assert kinds.pop(WEIGHTS_DIGEST_KEY) == weights_digest(out)
        assert kinds.pop(BLOCK_KINDS_KEY) == "q4_1,q8_0,q8_16"
        # Every matrix is kept: projections as Q4_1, embedding and output as Q8_0; the
        # norms (float32 in the GGUF) are not.
        assert set(kinds) == {n for n in expected if not n.endswith("norm.weight")}
        for name, kind in kinds.items():
            assert kind == ("q8_0" if "embed" in name or "lm_head" in name else "q4_1"), name
            blocks = BlockSource(f, name, kind).read()
            # Exact: Q and K rows come out unpermuted like the float32 weights.
            np.testing.assert_array_equal(blocks.dequantize().numpy(), expected[name], name)


def test_blocks_are_added_to_a_folder_converted_without_them(tmp_path, make_tiny_gguf):
    make_tiny_gguf(tmp_path / "tiny.gguf", quantized=True)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    original = (out / BLOCKS_FILE).read_bytes()
    (out / BLOCKS_FILE).unlink()
    write_blocks(tmp_path / "tiny.gguf", out)
    assert (out / BLOCKS_FILE).read_bytes() == original
    assert os.listdir((out / BLOCKS_FILE).parent) == [Path(BLOCKS_FILE).name]


def test_crash_midway_leaves_no_folder(tmp_path, make_tiny_gguf, monkeypatch):
    make_tiny_gguf(tmp_path / "tiny.gguf")
    real = gguf_import._write_json

    def write_then_fail(path, data):
        real(path, data)
        raise OSError("disk full")

    monkeypatch.setattr(gguf_import, "_write_json", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    assert sorted(os.listdir(tmp_path)) == ["tiny.gguf"]  # no model, no temp dir


# --- slow: the real default model against transformers' GGUF loader -------------------------

TOKENIZER_SAMPLES = [
    "Hello, world! How are you doing today?",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "\tindented with tabs\n\t\tand more\n",
    "digits: 12345 and 3.14159 and 1,000,000 and 0x1F",
    "unicode: café naïve Straße — “quotes” …",
    "emoji 🙂🚀👩‍💻 and CJK 你好，世界 and こんにちは and 한국어",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|endoftext|>",
    "   leading spaces",
    "trailing spaces   ",
    " one leading space",
    "multiple\n\n\nnewlines\r\nand CRLF",
    "",
    " ",
    "a",
    'MixedCASE words AND ACRONYMS like HTTP/2 & JSON: {"key": [1, 2]}',
]

# Text where whitespace directly precedes a numeric character (\p{N}, so also "²").
# llama.cpp's 'smollm' pre-tokenizer, like SmolLM2's own tokenizer.json, isolates every numeric
# character *before* the GPT-2 regex, so "  1" is ["ĠĠ", "1"] and " ²" is ["Ġ", "Â²"].
# transformers' GGUF loader has no 'smollm' entry and skips that split, giving ["Ġ", "Ġ", "1"]
# and ["ĠÂ", "²"]; for these the reference is llama.cpp's rule applied around transformers' BPE.
DIGIT_AFTER_WHITESPACE = [
    "  1",
    "x  12",
    "a\n\n1",
    "\t\t3",
    "hello   42 world",
    "    123",
    "½ ²",
    "x ³",
]


@pytest.fixture(scope="module")
def hf_reference(smollm2_gguf, smollm2_reference):
    """transformers' own model and tokenizer built from the same GGUF file (offline)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name
    )
    return smollm2_reference, tokenizer


@pytest.mark.slow
def test_config_matches_gguf_metadata(smollm2_dir, smollm2_gguf):
    from gguf import GGUFReader

    fields = GGUFReader(smollm2_gguf).fields

    def meta(key):
        return fields[key].contents()

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["hidden_size"] == meta("llama.embedding_length") == 576
    assert config["intermediate_size"] == meta("llama.feed_forward_length")
    assert config["num_hidden_layers"] == meta("llama.block_count") == 30
    assert config["num_attention_heads"] == meta("llama.attention.head_count") == 9
    assert config["num_key_value_heads"] == meta("llama.attention.head_count_kv") == 3
    assert config["head_dim"] == meta("llama.rope.dimension_count") == 64
    assert config["rms_norm_eps"] == meta("llama.attention.layer_norm_rms_epsilon")
    assert config["rope_theta"] == meta("llama.rope.freq_base") == 100000.0
    assert config["max_position_embeddings"] == meta("llama.context_length")
    assert config["vocab_size"] == meta("llama.vocab_size") == 49152
    assert config["bos_token_id"] == meta("tokenizer.ggml.bos_token_id")
    assert config["eos_token_id"] == meta("tokenizer.ggml.eos_token_id")
    assert config["tie_word_embeddings"] is True  # the file has no output.weight
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == meta("tokenizer.chat_template")
    assert tok_config["eos_token"] == "<|im_end|>"


@pytest.mark.slow
def test_weights_match_transformers_gguf_loader(smollm2_dir, hf_reference):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    reference, _ = hf_reference
    expected = reference.state_dict()
    ours = _load_safetensors(smollm2_dir / "model.safetensors")
    # transformers lists the tied lm_head in its state dict; the file correctly omits it.
    assert set(ours) | {"lm_head.weight"} == set(expected)
    for name, value in ours.items():
        diff = np.abs(value - expected[name].numpy()).max()
        assert diff == 0, f"{name}: max abs diff {diff}"

    # The config must mean the same model to transformers, not just hold the same numbers.
    ref_config, our_config = reference.config, AutoConfig.from_pretrained(str(smollm2_dir))
    for key in ("hidden_size", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(our_config, key) == getattr(ref_config, key), key
    assert our_config.rope_parameters["rope_theta"] == ref_config.rope_parameters["rope_theta"]
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 9690, 198, 19556, 905, 28, 1115, 359, 346, 47, 2, 198]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("text", TOKENIZER_SAMPLES)
def test_tokenizer_matches_transformers(smollm2_dir, hf_reference, text):
    _, reference = hf_reference
    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    ids = ours.encode(text).ids
    assert ids == reference(text).input_ids
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert reference.decode(ids) == text


@pytest.mark.slow
@pytest.mark.parametrize("text", DIGIT_AFTER_WHITESPACE)
def test_tokenizer_splits_digits_like_llama_cpp(smollm2_dir, hf_reference, text):
    import regex  # transformers' dependency; supports \p{N} like llama.cpp's splitter

    _, reference = hf_reference
    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    expected = []
    for piece in regex.split(r"(\p{N})", text):
        if piece:
            expected += reference(piece).input_ids
    ids = ours.encode(text).ids
    assert ids == expected
    assert ours.decode(ids) == text


@pytest.mark.slow
def test_transformers_loads_converted_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    loaded = AutoTokenizer.from_pretrained(str(smollm2_dir))
    for text in TOKENIZER_SAMPLES + DIGIT_AFTER_WHITESPACE:
        assert loaded(text).input_ids == ours.encode(text).ids, text
    prompt = loaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
