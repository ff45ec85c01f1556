"""The replica-ranking policy of the Serve request router (pure, no Serve needed)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve.request_router import FIFOMixin

from serve_app.protocol import ROUTING_HINT_ATTR, Subscription
from serve_app.routing.request_router import (
    Candidate,
    KVAwareRequestRouter,
    hints_can_route,
    rank_candidates,
)


def _c(rid: str, prefix: int = 0, load: int = 0, free: float = 1.0) -> Candidate:
    return Candidate(rid, prefix, load, free)


def _order(cands, **kw) -> list[str]:
    return [c.replica_id for c in rank_candidates(cands, **kw)]


def test_the_longest_held_prefix_wins_over_a_lighter_load():
    assert _order([_c("a", 0, 0), _c("b", 5, 3), _c("c", 2, 0)]) == ["b", "c", "a"]


def test_a_replica_loaded_beyond_the_threshold_loses_its_prefix_preference():
    cands = [_c("hot", prefix=8, load=20), _c("idle", prefix=0, load=1)]
    assert _order(cands, imbalance_threshold=8) == ["idle", "hot"]
    assert _order(cands, imbalance_threshold=32) == ["hot", "idle"]


def test_without_prefix_the_least_loaded_then_the_most_free_kv_wins():
    cands = [_c("a", load=3, free=0.9), _c("b", load=1, free=0.1), _c("c", load=1, free=0.8)]
    assert _order(cands) == ["c", "b", "a"]


def test_exact_ties_are_broken_at_random_so_new_replicas_get_traffic():
    cands = [_c(str(i)) for i in range(4)]
    firsts = {_order(cands)[0] for _ in range(200)}
    assert firsts == {"0", "1", "2", "3"}


def test_no_candidates_rank_to_nothing():
    assert rank_candidates([]) == []


# KVAwareRequestRouter.choose_replicas reads only these of Serve's objects, so they stand
# in for a running Serve here.
def _replica(rid: str, **routing_stats) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=routing_stats)


def _router(queue_lens: dict[str, int] | None = None) -> KVAwareRequestRouter:
    router = KVAwareRequestRouter.__new__(KVAwareRequestRouter)  # Serve builds it with its state
    router.initialize_state(imbalance_threshold=8)
    lens = queue_lens or {}
    # Behind Serve's read-only `replica_queue_len_cache`: what the handle saw queued.
    router._replica_queue_len_cache = SimpleNamespace(get=lambda rid: lens.get(rid.unique_id))
    return router


def _choose(router, replicas, first) -> list[list[str]]:
    pending = SimpleNamespace(args=(first,))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_a_request_goes_to_its_prefix_holder_then_to_every_other_replica_in_order():
    replicas = [
        _replica(r, num_ongoing=0, kv_free_fraction=f)
        for r, f in (("a", 0.9), ("b", 0.5), ("c", 0.1))
    ]
    request = SimpleNamespace(**{ROUTING_HINT_ATTR: {"c": 3}})
    assert _choose(_router(), replicas, request) == [["c"], ["a"], ["b"]]


def test_full_prefix_holders_do_not_keep_a_request_from_a_replica_with_room():
    # r1 and r2 hold the longest prefixes and are full (Serve skips them); r3, within the
    # imbalance threshold of them, has room and must be among the ranks Serve tries.
    replicas = [_replica(r) for r in ("r1", "r2", "r3")]
    request = SimpleNamespace(**{ROUTING_HINT_ATTR: {"r1": 10, "r2": 9, "r3": 8}})
    ranks = _choose(_router({"r1": 129, "r2": 129, "r3": 122}), replicas, request)
    assert ranks == [["r1"], ["r2"], ["r3"]]


def test_choices_are_handed_out_first_in_first_out():
    # Not Serve's default matching by internal request id, which the calls one request
    # makes share: all but the first would never be fulfilled, their routing tasks
    # spinning (serve_app/routing/request_router.py's docstring).
    assert issubclass(KVAwareRequestRouter, FIFOMixin)


def test_the_queue_length_this_handle_saw_beats_the_periodic_stats():
    # Stats say a is idle; this handle has just queued 5 requests on it.
    replicas = [_replica("a", num_ongoing=0), _replica("b", num_ongoing=2)]
    assert _choose(_router({"a": 5}), replicas, SimpleNamespace())[0] == ["b"]
    assert _choose(_router(), replicas, SimpleNamespace())[0] == ["a"]


def test_a_subscription_goes_to_the_replica_it_names_while_that_one_runs():
    replicas = [_replica("a", num_ongoing=0), _replica("b", num_ongoing=9)]
    assert _choose(_router(), replicas, Subscription("router-1", "b")) == [["b"]]
    # Gone: ranked like any request (the router then lets the subscription go).
    assert _choose(_router(), replicas, Subscription("router-1", "gone"))[0] == ["a"]


def test_a_negative_imbalance_threshold_is_refused():
    router = KVAwareRequestRouter.__new__(KVAwareRequestRouter)
    with pytest.raises(ValueError, match="imbalance_threshold must be >= 0"):
        router.initialize_state(imbalance_threshold=-1)


def test_a_replica_whose_engine_failed_gets_nothing_while_another_can_serve():
    dead = _replica("dead", healthy=0.0)
    replicas = [dead, _replica("a", num_ongoing=6, healthy=1.0), _replica("fresh")]
    request = SimpleNamespace(**{ROUTING_HINT_ATTR: {"dead": 8}})  # its registry entries
    ranks = _choose(_router({"dead": 0}), replicas, request)
    assert sorted(r for rank in ranks for r in rank) == ["a", "fresh"]
    # None healthy: the call goes to one anyway and fails fast, rather than waiting.
    assert _choose(_router(), [dead], request) == [["dead"]]


def test_prefix_hints_route_only_where_a_pool_has_a_choice():
    pools = ["PrefillServer", "DecodeServer"]
    assert not hints_can_route({"PrefillServer": 1, "DecodeServer": 1, "Router": 3}, pools)
    assert hints_can_route({"PrefillServer": 2, "DecodeServer": 1}, pools)
    assert hints_can_route({"PrefillServer": 1, "DecodeServer": 4}, pools)
    assert not hints_can_route({"PrefillServer": 0}, pools)  # nothing to choose from
    assert hints_can_route(None, pools)  # not known yet: ask
    assert not hints_can_route({"EngineServer": 1}, ["EngineServer"])
