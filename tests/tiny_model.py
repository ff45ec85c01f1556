"""Small random-weight Llama folders for fast tests.

Written by transformers itself (`save_pretrained`), so loading them also checks
that Baton reads real Hugging Face checkpoints; the tokenizer is a byte-level
BPE with no merges (one token per byte) plus chat markup tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def make_tiny_model(
    out_dir: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 320,
    tie_word_embeddings: bool = False,
    eos_token_id: int = 0,
    seed: int = 0,
    **extra_config,
) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        **extra_config,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    # Default init gives near-uniform logits; larger weights make greedy choices
    # decisive, so batch-invariance tests compare real decisions, not ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return save_folder(model, out_dir)


def save_folder(model, out_dir: Path) -> Path:
    """A transformers model written as a Hugging Face folder, with the byte tokenizer and
    the chat template."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _byte_tokenizer().save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>"})
    )
    return out_dir


def random_prompts(n: int, seed: int = 1, vocab_size: int = 320) -> list[list[int]]:
    """`n` prompts of 1-89 random non-special tokens, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (n,), generator=g).tolist()
    return [torch.randint(len(SPECIALS), vocab_size, (k,), generator=g).tolist() for k in lengths]
