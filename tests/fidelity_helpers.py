"""What the real-model fidelity tests (test_*_fidelity.py) share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from workers.kv.kv_groups import KVCacheGroups
from workers.model.config import ModelConfig
from workers.runner.model_runner import ModelRunner
from workers.runner.step_io import SeqChunk, StepInput

# Plain prompts of several scripts and kinds (prose, code, SQL, numbers, emoji).
PLAIN = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Les mathématiques sont la science qui étudie",
    "日本の首都は東京です。東京は",
    "Emoji check 🙂🚀: the rocket",
    "SELECT name, COUNT(*) FROM users WHERE",
    "1, 2, 3, 5, 8, 13, 21,",
]


def last_position_logits(
    model_dir: Path,
    prompts: list[list[int]],
    max_model_len: int,
    dtype: torch.dtype = torch.float32,
) -> Iterator[torch.Tensor]:
    """The model runner's logits at each prompt's last position, one whole prefill each."""
    longest = -(-max(len(p) for p in prompts) // 16)
    groups = KVCacheGroups.of(ModelConfig.from_pretrained(model_dir)).num_groups
    runner = ModelRunner(
        model_dir,
        num_blocks=longest * groups,
        block_size=16,
        max_model_len=max_model_len,
        dtype=dtype,
    )
    for prompt in prompts:
        n = -(-len(prompt) // 16)
        # Each KV-cache group its own blocks, as the engine's pool hands them out.
        tables = [list(range(g * longest, g * longest + n)) for g in range(groups)]
        yield runner.execute(StepInput([SeqChunk(prompt, 0, tables, sample=True)])).logits[0]
