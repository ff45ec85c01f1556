"""Cache-aware replica choice, plugged into Ray Serve's request-router extension point.

Every engine pool's deployment uses `KVAwareRequestRouter` (its `request_router_config`),
so every `DeploymentHandle` call to a pool is placed by it. A request's first argument is
an `EngineRequest` whose `prefix_hits` the router filled from the prefix registry; each
replica reports its load and KV usage through `record_routing_stats`.

The order, per request:
1. replicas holding the longest prefix of the prompt (a hit skips that much prefill, or
   that much KV transfer on a decode replica), unless such a replica is loaded beyond
   the least loaded one by `imbalance_threshold` requests: a popular prefix must not pile
   every request on one replica;
2. then the least loaded (ongoing requests);
3. then the most free KV blocks (room to admit without preempting);
4. then at random, so idle replicas (a freshly added one too) share the traffic.

A replica whose engine has failed (its routing stats say `healthy: 0`) is left out while
any other can take the request.

Serve tries the ranks in order and skips replicas at their max_ongoing_requests: every
replica is ranked, so a full prefix holder never keeps a request from one with room.

`FIFOMixin` gives a chosen replica to the oldest pending request, not always the one it
was ranked for: under contention a prefix hit can go to another request. Serve's own
matching (by internal request id) cannot replace it, as every call a replica makes while
serving one request (a router's choices and its output subscription, a decode replica's
prefill calls) carries that request's id: only the first is indexed, and the routing
task of another would never see its request fulfilled and spin.

A router's output subscription (`Subscription`, streaming/output_channels.py) goes to the replica it
names; if that replica is gone, it is ranked like a request (the router sees where it
landed and lets it go).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from serve_app.protocol import ROUTING_HINT_ATTR, Subscription

DEFAULT_IMBALANCE_THRESHOLD = 8


@dataclass(frozen=True)
class Candidate:
    replica_id: str
    prefix_blocks: int  # leading prompt blocks it holds, per the registry
    load: int  # ongoing requests
    kv_free_fraction: float  # free KV blocks / total


def rank_candidates(
    candidates: list[Candidate], imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD
) -> list[Candidate]:
    """Best first: see the module docstring. Pure, so the policy is tested without Serve."""
    if not candidates:
        return []
    least_load = min(c.load for c in candidates)

    def key(c: Candidate) -> tuple[int, int, float]:
        balanced = c.load <= least_load + imbalance_threshold
        held = c.prefix_blocks if balanced else 0
        return (-held, c.load, -c.kv_free_fraction)

    shuffled = random.sample(candidates, len(candidates))
    return sorted(shuffled, key=key)  # stable: ties keep the random order


def hints_can_route(running: Mapping[str, int] | None, deployments: Iterable[str]) -> bool:
    """Whether prefix hints can change where a request goes: some of the pools it passes
    through (`deployments`) has more than one running replica (`running`, per deployment;
    None when not known yet, which counts as yes). A pool of one has no choice to make."""
    if running is None:
        return True
    return any(running.get(name, 0) > 1 for name in deployments)


class KVAwareRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD) -> None:
        if imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {imbalance_threshold}")
        self.imbalance_threshold = imbalance_threshold

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        hits: dict[str, int] = {}
        first = pending_request.args[0] if pending_request and pending_request.args else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if isinstance(first, Subscription) and first.replica_id in by_id:
            return [[by_id[first.replica_id]]]
        if first is not None:
            hits = getattr(first, ROUTING_HINT_ATTR, None) or {}
        # A replica whose engine failed answers every call with an error at once. With
        # no healthy one left, the call goes on and fails fast (UNAVAILABLE) rather than
        # waiting for replacements that may never come up.
        healthy = [r for r in candidate_replicas if _healthy(r)] or candidate_replicas
        ranked = rank_candidates(
            [self._candidate(r, hits) for r in healthy],
            getattr(self, "imbalance_threshold", DEFAULT_IMBALANCE_THRESHOLD),
        )
        return [[by_id[c.replica_id]] for c in ranked]

    def _candidate(self, replica: RunningReplica, hits: dict[str, int]) -> Candidate:
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        # The queue length this handle saw last is fresher than the periodic stats.
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        load = queued if queued is not None else int(stats.get("num_ongoing", 0))
        return Candidate(
            replica_id=rid,
            prefix_blocks=int(hits.get(rid, 0)),
            load=load,
            kv_free_fraction=float(stats.get("kv_free_fraction", 1.0)),
        )


def _healthy(replica: RunningReplica) -> bool:
    # No stats yet (a replica just started) counts as healthy.
    return float((replica.routing_stats or {}).get("healthy", 1.0)) > 0.0
