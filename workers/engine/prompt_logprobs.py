"""Prompt logprobs: how likely the model found each prompt token, given those before it.

A request that asks (`SamplingParams.prompt_logprobs`) has its prompt computed whole,
prefix cache or not (a cached position has no logits), and each prefill chunk names the
prompt tokens its positions predict (`SeqChunk.prompt_targets`: position i predicts
token i + 1); the runner returns their logprobs and top alternatives, computed where the
logits are, so no vocabulary-wide row per position reaches the host or goes through Ray
from a TP rank. They
are the model's own distribution, before any penalty, bias or temperature, as sampled
tokens' logprobs are. Each position is recorded once and in order, so a sequence
preempted mid-prompt recomputes its positions but does not record them twice.
"""

from __future__ import annotations

from workers.engine.sampling_params import TokenLogprob
from workers.engine.sequence import Sequence
from workers.runner.step_io import PromptLogprobRows


def due_targets(seq: Sequence, start: int, num_tokens: int) -> tuple[int, list[int]]:
    """For a chunk of `num_tokens` from position `start`: the offset in it of the first
    position whose prompt logprob is due, and the prompt tokens that the due positions
    from there predict (none: nothing is due)."""
    if not seq.num_prompt_logprobs_due:
        return 0, []
    first = len(seq.prompt_logprobs)
    end = min(start + num_tokens, seq.num_prompt_tokens - 1)
    if end <= first:
        return 0, []
    if start > first:  # find_cached_prefix never skips a due position
        raise RuntimeError(
            f"{seq.request_id}: a chunk from position {start} skips prompt logprobs due "
            f"from {first}"
        )
    return first - start, seq.prompt_token_ids[first + 1 : end + 1]


def record(seq: Sequence, rows: PromptLogprobRows) -> None:
    """Appends what the runner computed for the targets `due_targets` gave."""
    first = len(seq.prompt_logprobs)
    targets = seq.prompt_token_ids[first + 1 : first + 1 + len(rows.logprobs)]
    seq.prompt_logprobs.extend(
        TokenLogprob(token, logprob, tuple(zip(ids, values, strict=True)), rank)
        for token, logprob, ids, values, rank in zip(
            targets,
            rows.logprobs.tolist(),
            rows.top_ids.tolist(),
            rows.top_logprobs.tolist(),
            rows.ranks.tolist(),
            strict=True,
        )
    )
