"""The tokens each sampling row of a step may take, computed while the model runs.

A row's mask depends only on the tokens its request has accepted, all known before the
step, so it is computed on a thread of its own during the model's forward pass (the
grammar engine and torch both let go of the GIL); the sampler applies it to the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from workers.engine.grammar_matcher import GrammarMatcher

# A mask as the sampler takes it: the constrained rows' indices, and for each of them
# which of the vocabulary's tokens it may take.
Mask = tuple[list[int], torch.Tensor]


class TokenMasks:
    def __init__(self, vocab_size: int):
        """`vocab_size`: the logits' width."""
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="token-masks")

    def start(
        self, rows: Sequence[tuple[GrammarMatcher | None, Sequence[int]]]
    ) -> Future[Mask] | None:
        """Starts computing the masks of a step's sampling sequences, given as (matcher or
        None, drafts): a sequence takes one row, then one per draft. None when no row is
        constrained. The matchers must not change until the future is done."""
        if all(matcher is None for matcher, _ in rows):
            return None
        return self._thread.submit(self._compute, list(rows))

    def _compute(self, rows: list[tuple[GrammarMatcher | None, Sequence[int]]]) -> Mask:
        constrained: list[int] = []
        fills: list[tuple[GrammarMatcher, int, Sequence[int]]] = []
        row = 0
        for matcher, drafts in rows:
            if matcher is not None:
                fills.append((matcher, len(constrained), drafts))
                constrained += range(row, row + len(drafts) + 1)
            row += len(drafts) + 1
        bitmask = torch.zeros(len(constrained), self._words, dtype=torch.int32)
        for matcher, at, drafts in fills:
            matcher.fill(bitmask, at, drafts)
        # Bit t % 32 of word t // 32 is bit t % 8 of byte t // 8 (little-endian words).
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        return constrained, torch.from_numpy(bits.view(np.bool_))[:, : self.vocab_size]

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
