"""serve_app/engine_server.py's own decisions, on a replica object built without Serve
(the request paths run end to end in test_service*.py; the decode role's handoff in
test_decode_handoff.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from serve_app.engine_server import EngineServer


class _Replica(EngineServer):
    def __del__(self) -> None:  # Serve awaits the real one on shutdown; nothing to undo here
        pass


def test_a_replica_whose_engine_failed_withdraws_from_routing_and_the_registry_once():
    replica = _Replica.__new__(_Replica)  # only what record_routing_stats reads
    removed = []
    replica.role, replica.replica_id, replica._withdrawn = "decode", "r1", False
    replica.engine = SimpleNamespace(is_healthy=lambda: False)
    replica.registry = SimpleNamespace(remove_replica=SimpleNamespace(remote=removed.append))
    assert replica.record_routing_stats() == {"healthy": 0.0}
    assert replica.record_routing_stats() == {"healthy": 0.0}
    assert removed == ["r1"]


def test_a_replica_whose_engine_failed_fails_serves_health_check():
    # What makes Serve replace it (after three failed checks).
    replica = _Replica.__new__(_Replica)
    replica.role, replica.replica_id = "prefill", "r2"
    healthy = [True]
    replica.engine = SimpleNamespace(is_healthy=lambda: healthy[0])
    replica.check_health()
    healthy[0] = False
    with pytest.raises(RuntimeError, match="prefill replica r2: its engine has failed"):
        replica.check_health()
