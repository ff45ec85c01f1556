"""serve_app/status_board.py as a plain object (the actor around it is Ray's): what
`baton status` and `baton scale` read back."""

from __future__ import annotations

from types import SimpleNamespace

from serve_app import status_board
from serve_app.status_board import StatusBoard


def test_a_replica_that_stops_posting_drops_out_after_max_age(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(status_board, "time", SimpleNamespace(monotonic=lambda: now[0]))
    board = StatusBoard()
    board.post("a", {"replica_id": "a", "n": 1})
    now[0] += 5.0
    board.post("b", {"replica_id": "b"})
    board.post("a", {"replica_id": "a", "n": 2})  # a later post replaces the earlier
    assert board.snapshots(max_age_s=10.0) == [{"replica_id": "a", "n": 2}, {"replica_id": "b"}]
    now[0] += 8.0
    board.post("a", {"replica_id": "a", "n": 3})
    now[0] += 3.0  # b last posted 11 s ago
    assert board.snapshots(max_age_s=10.0) == [{"replica_id": "a", "n": 3}]
    now[0] += 11.0
    assert board.snapshots(max_age_s=10.0) == []


def test_a_removed_replica_is_gone_at_once_and_configs_are_kept_per_app():
    board = StatusBoard()
    board.post("a", {"replica_id": "a"})
    board.remove("a")
    board.remove("never-posted")
    assert board.snapshots() == []
    assert board.config("baton") is None
    assert board.set_config("baton", {"mode": "aggregated"}) is None
    board.set_config("other", {"mode": "disaggregated"})
    assert board.config("baton") == {"mode": "aggregated"}
    # Replacing or forgetting (a stopped app) hands back what was kept, to restore.
    assert board.set_config("baton", {"mode": "x"}) == {"mode": "aggregated"}
    assert board.set_config("baton", None) == {"mode": "x"}
    assert board.config("baton") is None and board.config("other") is not None
