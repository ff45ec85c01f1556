"""One request's place in its grammar: which tokens may come next, advanced per token."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch


class GrammarMatcher:
    """Wraps a request's own llguidance matcher (GrammarCompiler.matcher makes one)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no more tokens (nor does a broken one)."""
        return self._matcher.is_stopped()

    def accept(self, token: int) -> bool:
        """Advances past a sampled token; False if the grammar did not allow it (it is
        then broken, and `done`)."""
        return self._matcher.consume_token(token)

    def num_valid(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here (drafts)."""
        return self._matcher.validate_tokens(list(tokens))

    def fill(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> None:
        """Writes the allowed tokens as bits into `bitmask[row]` (int32, bit t % 32 of word
        t // 32), and, for each of `drafts` (which `num_valid` allowed), into the next row
        as if it were accepted; the matcher ends where it started."""
        consumed = 0
        for j in range(len(drafts) + 1):
            if j and consumed == j - 1:
                consumed += self._matcher.try_consume_tokens([drafts[j - 1]])
            words = bitmask[row + j]
            if consumed == j:
                self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
            else:
                # After a draft the grammar refuses, rows are never kept (that draft
                # cannot be sampled), so any valid mask will do: the row before's.
                words.copy_(bitmask[row + j - 1])
        if consumed:
            self._matcher.rollback(consumed)
