"""What the real-model fidelity tests (test_*_fidelity.py) share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

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
    longest = max(len(p) for p in prompts)
    runner = ModelRunner(
        model_dir,
        num_blocks=-(-longest // 16),
        block_size=16,
        max_model_len=max_model_len,
        dtype=dtype,
    )
    for prompt in prompts:
        table = list(range(-(-len(prompt) // 16)))
        yield runner.execute(StepInput([SeqChunk(prompt, 0, table, sample=True)])).logits[0]
