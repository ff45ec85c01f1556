"""What `baton bench` sends: prompts with their output lengths, from flags or a JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Common English words: most tokenizers give about one token each (with its leading
# space), so a prompt of N of them is about N tokens; the server's usage says exactly.
_WORDS = (  # noqa: SIM905 (a paragraph reads better than 85 quoted words)
    "the of and to in is was for on that with as by at from his it an were are which this "
    "be or has had not but all they their one its first new after who been more two "
    "time can when other there also into only over most some such any than then these "
    "many may would about him could her city year part world state under people way "
    "between during three before each where both well same long name used through while"
).split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int


def synthetic(num: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """`num` distinct prompts of `input_len` words, each asking for `output_len` tokens.
    Distinct from their first word, so a prefix cache does not serve one from another."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise ValueError(
            f"--num-prompts, --input-len and --output-len must be >= 1, got {num}, "
            f"{input_len}, {output_len}"
        )
    rng = random.Random(seed)
    return [
        BenchRequest(
            f"{i} " + " ".join(rng.choice(_WORDS) for _ in range(input_len - 1)), output_len
        )
        for i in range(num)
    ]


def from_jsonl(path: Path, output_len: int, num: int | None) -> list[BenchRequest]:
    """One request per line: {"prompt": "...", "max_tokens": N} (max_tokens optional:
    `output_len`); the first `num` lines, or all."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, max_tokens = row["prompt"], int(row.get("max_tokens", output_len))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f'--dataset {path}:{number}: each line must be {{"prompt": "...", '
                    f'"max_tokens": N}} (max_tokens optional): {e}'
                ) from None
            if not isinstance(prompt, str) or not prompt or max_tokens < 1:
                raise ValueError(
                    f"--dataset {path}:{number}: prompt must be a non-empty string and "
                    "max_tokens >= 1"
                )
            requests.append(BenchRequest(prompt, max_tokens))
            if num is not None and len(requests) == num:
                break
    if not requests:
        raise ValueError(f"--dataset {path}: no prompts in it")
    return requests
