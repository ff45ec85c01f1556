"""A router's lookups in the prefix registry (prefix_registry.py), bounded in time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import ray

from serve_app.routing.prefix_registry import PrefixRegistryConfig, get_or_create_registry
from workers.engine import BlockHash

logger = logging.getLogger(__name__)


class RegistryLookup:
    """A router's way to the registry: the hints for a prompt, or none. Losing the
    registry (a new one is started) or waiting on it past `wait_s` (it restarts, or falls
    behind every replica's cache events) costs routing hints, never a request or more
    than `wait_s` of its latency."""

    def __init__(self, config: PrefixRegistryConfig, wait_s: float) -> None:
        self.config, self.wait_s = config, wait_s
        self.actor = get_or_create_registry(config)
        self.num_timeouts = 0

    async def longest_prefixes(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        lookup = self.actor.longest_prefixes.remote(list(block_hashes))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(lookup.future()), self.wait_s)
        except ray.exceptions.RayActorError:
            logger.warning("the prefix registry is gone; starting a new one")
            self.actor = get_or_create_registry(self.config)
        except asyncio.TimeoutError:
            self.num_timeouts += 1
            if self.num_timeouts & (self.num_timeouts - 1) == 0:  # the 1st, 2nd, 4th... time
                logger.warning(
                    "the prefix registry took over %.2f s to answer (%d times so far); "
                    "routing without its hints",
                    self.wait_s,
                    self.num_timeouts,
                )
        return {}
