"""The replica-ranking policy of the Serve request router (pure, no Serve needed)."""

from __future__ import annotations

from serve_app.request_routing import Candidate, rank_candidates


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
