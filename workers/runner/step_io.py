"""One step as plain data: what the engine asks of a runner (`StepInput`, a `SeqChunk` per
scheduled sequence) and what comes back (`StepOutput`). Plain data, so the same step can
run in the engine's process or be sent to every rank of a tensor-parallel group."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqChunk:
    """New tokens of one sequence for this step."""

    token_ids: list[int]
    start_pos: int  # position of token_ids[0]; everything before is cached
    # One per KV-cache group (workers/kv/kv_groups.py); a sliding group's entries behind
    # its window are negative (none held) and never read.
    block_tables: list[list[int]]
    sample: bool  # the chunk ends the sequence's known tokens, so it yields logits
    # Speculated tokens ending the chunk; a sampling chunk then yields logits at each of
    # them and at the token before them.
    num_drafts: int = 0
    # Prompt logprobs due in this chunk (prompt_logprobs.py): the prompt tokens that its
    # positions from `prompt_from` on predict, and how many alternatives to return each.
    prompt_targets: list[int] = field(default_factory=list)
    prompt_from: int = 0
    prompt_top_n: int = 0


@dataclass
class StepInput:
    # Any order: the runner batches single-token chunks (decodes) itself and
    # returns logits in chunk order.
    chunks: list[SeqChunk] = field(default_factory=list)


@dataclass
class PromptLogprobRows:
    """One chunk's prompt logprobs, computed where its logits are (only these leave the
    device, not a vocabulary-wide row per position): the targets' logprobs [m], the
    top-n token ids and logprobs [m, n], and the targets' ranks [m] (the tokens the model
    found at least as likely, the target included: a tie ranks low, as in vLLM)."""

    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass
class StepOutput:
    # One row per sampling chunk, plus one per draft it ends with, in chunk order.
    logits: torch.Tensor
    # By chunk index, for the chunks with prompt_targets.
    prompt_logprobs: dict[int, PromptLogprobRows] = field(default_factory=dict)
