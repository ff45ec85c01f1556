"""Selective disaggregation: whether a decode replica prefills a prompt itself, with no
handoff, rather than ask the prefill pool for it (off by default; `AppConfig`'s
`local_prefill_tokens` and `max_pending_prefills`).

Decode takes a prompt when little of it is uncached, or when it already waits on enough
prefill calls that the pool would queue this one: a burst the prefill pool would hold up
is then taken by decode's own compute. How the prompt then reaches its first token, here
or by a handoff, is serve_app/handoff/decode_handoff.py.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class SelectiveDisaggregation:
    """One decode replica's choice, and the calls to the prefill pool it counts for it."""

    def __init__(self, local_prefill_tokens: int = 0, max_pending_prefills: int | None = None):
        self.local_prefill_tokens = local_prefill_tokens
        self.max_pending_prefills = max_pending_prefills
        self.num_pending_prefills = 0  # calls to the prefill pool in flight

    def prefills_here(self, uncached_tokens: int) -> bool:
        """Whether this replica prefills a prompt with `uncached_tokens` uncached itself."""
        if self.local_prefill_tokens and uncached_tokens <= self.local_prefill_tokens:
            return True
        limit = self.max_pending_prefills
        return limit is not None and self.num_pending_prefills >= limit

    async def pending(self, answer: Awaitable[T]) -> T:
        """The prefill pool's `answer` to a call, counted as pending while it is awaited."""
        self.num_pending_prefills += 1
        try:
            return await answer
        finally:
            self.num_pending_prefills -= 1
