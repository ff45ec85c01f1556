"""What the router and the engine replicas send each other (plain, picklable data).

The router turns a client request into an `EngineRequest` (tokens, checked sampling
parameters, block hashes and the registry's answer of who holds how much of the
prefix); engine replicas stream `RequestOutput`s back, on the call or, batched per
step, on the router's `Subscription` (streaming/output_channels.py). In disaggregated
mode the decode replica asks the prefill pool for a `PrefillResult`: the first token
and the KV blocks decode lacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: Serve imports this module wherever it reads the
    # request router's config (`baton status` too), which must not load the engine
    from workers.engine import BlockHash, KVHandle, KVPart, RequestOutput, SamplingParams

# Serve's request router reads this attribute of a request's first argument.
ROUTING_HINT_ATTR = "prefix_hits"


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None
    # The prompt's full blocks, hashed as every engine hashes them.
    block_hashes: tuple[BlockHash, ...]
    # Serve replica id -> leading blocks of this prompt the prefix registry says it holds
    # (advisory: routing prefers long prefixes, engines confirm every block anyway).
    prefix_hits: Mapping[str, int] = field(default_factory=dict)
    # The router's id for output multiplexing (streaming/output_channels.py); None: outputs
    # on the call.
    router_id: str | None = None


@dataclass(frozen=True)
class ChannelAddress:
    """Where a replica's channel server (streaming/channel_server.py) takes subscriptions
    over a socket of their own, and the token a subscriber must show."""

    host: str
    port: int
    token: str


@dataclass(frozen=True)
class StreamStart:
    """A generate call's first item: the replica that took it, and whether its outputs
    follow on the call (False) or on the router's subscription to that replica (True)."""

    replica_id: str
    muxed: bool
    # A muxed call's subscription: the router checks that it is the one it has, not an
    # earlier one to the same replica that ended meanwhile with this call's outputs.
    # None from a replica of an earlier release (mid rolling upgrade): not checked.
    subscription_id: str | None = None
    # Where the router subscribes over a socket (its first subscription, or a new one
    # taking over a channel it gave up); None: by Serve's call only.
    channel: ChannelAddress | None = None


@dataclass(frozen=True)
class Subscription:
    """A router's subscribe call, pinned by the request router to `replica_id`;
    `subscription_id` tells this call from the router's earlier ones to that replica."""

    router_id: str
    replica_id: str
    subscription_id: str | None = None


@dataclass(frozen=True)
class PrefillResult:
    """The prefill replica's answer: the first sampled token's output and, unless that
    token ended the request, the KV handle and the blocks from `skip_blocks` on."""

    output: RequestOutput
    handle: KVHandle | None
    # One per prefill TP rank: the KVBlocks themselves (object store transport), or
    # KVRefs to pull them from the prefill ranks (Ray Direct Transport).
    kv_parts: list[KVPart]
    prefill_s: float  # request arrival at the replica -> first token sampled

    @property
    def num_bytes(self) -> int:
        return sum(p.nbytes for p in self.kv_parts)
