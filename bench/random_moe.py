"""Writes a random-weight mixture-of-experts model of realistic shape, for
`bench/engine.py --model DIR`: Qwen3-MoE (or --arch mixtral) with hidden 1024, 8 experts
of 1024, top-2, 8 layers, 16 query and 4 KV heads of 64, and the default model's
tokenizer and vocabulary, saved by transformers itself. No such checkpoint can be fetched
here; the weights' values do not change the work a step does.

    .venv/bin/python bench/random_moe.py OUT_DIR [--arch qwen3_moe|mixtral]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from workers.model.model_cache import ensure_default_model

SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=["qwen3_moe", "mixtral"], default="qwen3_moe")
    args = parser.parse_args()
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    default = ensure_default_model()
    vocab = json.loads((default / "config.json").read_text())
    ids = {k: vocab[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")}
    if args.arch == "mixtral":
        config = MixtralConfig(
            **SHAPE, **ids, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2
        )
        model_class = MixtralForCausalLM
    else:
        config = Qwen3MoeConfig(
            **SHAPE,
            **ids,
            intermediate_size=2048,
            moe_intermediate_size=1024,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
        model_class = Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = model_class(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(args.out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(default / name, args.out_dir / name)
    print(args.out_dir)


if __name__ == "__main__":
    main()
