"""Prompt logprobs: how likely the model found each prompt token, given those before it.

A request that asks (`SamplingParams.prompt_logprobs`) has its prompt computed whole,
prefix cache or not (a cached position has no logits), and its prefill chunks yield
logits at every position instead of only the last (`SeqChunk.all_logits`): position i
gives token i + 1's logprob. They are the model's own distribution, before any penalty,
bias or temperature, as sampled tokens' logprobs are. Rows are recorded in order and
once, so a sequence preempted mid-prompt recomputes but does not record them twice.
"""

from __future__ import annotations

import torch

from workers.engine.model_runner import SeqChunk
from workers.engine.sampler import top_logprobs
from workers.engine.sequence import Sequence


def wants_all_logits(seq: Sequence, start: int, num_tokens: int) -> bool:
    """Whether a chunk of `num_tokens` from `start` covers a position whose prompt logprob
    is still due (never past the first due one: find_cached_prefix keeps it so)."""
    return seq.num_prompt_logprobs_due > 0 and start + num_tokens > len(seq.prompt_logprobs)


def take_prompt_logprobs(
    chunks: list[tuple[Sequence, SeqChunk]], logits: torch.Tensor
) -> torch.Tensor:
    """Records the prompt logprobs that the `all_logits` chunks' rows give (the runner's
    logits for these chunks, in order) and returns the rows left to sample from."""
    keep: list[int] = []
    row = 0
    for seq, chunk in chunks:
        if chunk.all_logits:
            n = len(chunk.token_ids)
            _record(seq, chunk.start_pos, logits[row : row + n])
            if chunk.sample:
                keep.append(row + n - 1)
            row += n
        elif chunk.sample:
            keep.extend(range(row, row + 1 + chunk.num_drafts))
            row += 1 + chunk.num_drafts
    assert row == logits.shape[0], (row, logits.shape)
    return logits[keep]


@torch.inference_mode()  # the runner's logits are inference tensors, changed in place
def _record(seq: Sequence, start: int, rows: torch.Tensor) -> None:
    first = len(seq.prompt_logprobs)
    end = min(start + rows.shape[0], seq.num_prompt_tokens - 1)
    if end <= first:
        return
    if start > first:
        raise RuntimeError(
            f"{seq.request_id}: a chunk from position {start} skipped prompt logprobs "
            f"due from {first}"
        )
    # In place: these rows are read for nothing else, and a chunk's can be hundreds of MB.
    logprobs = rows[first - start : end - start]
    logprobs -= logprobs.logsumexp(dim=1, keepdim=True)
    targets = torch.tensor(seq.prompt_token_ids[first + 1 : end + 1], dtype=torch.long)
    seq.prompt_logprobs.extend(
        top_logprobs(logprobs, targets, [seq.params.prompt_logprobs] * len(targets))
    )
