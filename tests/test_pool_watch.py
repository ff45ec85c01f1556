"""serve_app/pool_watch.py: the controller's answers as a replica reads them."""

from __future__ import annotations

import asyncio
import threading
import time

from serve_app import pool_watch
from serve_app.pool_watch import PoolWatch


def _answering(monkeypatch, answers: list[dict[str, int]], gate: threading.Event | None = None):
    """Makes the controller answer `answers` in turn (the last one from then on), each
    once `gate` is set."""

    def running_replicas() -> dict[str, int]:
        if gate is not None:
            gate.wait()
        return answers.pop(0) if len(answers) > 1 else answers[0]

    monkeypatch.setattr(pool_watch, "running_replicas", running_replicas)


def _settled(watch: PoolWatch) -> None:
    deadline = time.monotonic() + 5
    while watch._pending is not None and time.monotonic() < deadline:
        time.sleep(0.005)


def test_a_pool_counts_as_running_until_the_controller_first_answers(monkeypatch):
    gate = threading.Event()
    _answering(monkeypatch, [{"PrefillServer": 0}], gate)
    watch = PoolWatch("PrefillServer")
    assert watch.has_running() and watch.counts() is None
    gate.set()
    _settled(watch)
    assert not watch.has_running()
    assert watch.counts() == {"PrefillServer": 0}


def test_an_answer_from_before_the_pool_started_is_asked_again_when_it_matters(monkeypatch):
    # The first answer came while the application deployed; the pool runs by the time a
    # request reads the watch, well inside REFRESH_S of that answer.
    _answering(monkeypatch, [{"PrefillServer": 0}, {"PrefillServer": 1}])
    watch = PoolWatch("PrefillServer")
    watch.counts()
    _settled(watch)
    assert not watch.has_running()  # the stale answer, and no new question yet
    asyncio.run(watch.refreshed(5.0))
    assert watch.has_running()


def test_a_controller_that_does_not_answer_in_time_leaves_the_last_answer(monkeypatch):
    gate = threading.Event()
    _answering(monkeypatch, [{"PrefillServer": 0}])
    watch = PoolWatch("PrefillServer")
    watch.counts()
    _settled(watch)
    _answering(monkeypatch, [{"PrefillServer": 1}], gate)
    start = time.monotonic()
    asyncio.run(watch.refreshed(0.05))
    assert time.monotonic() - start < 1.0
    assert not watch.has_running()
    gate.set()
    _settled(watch)
    assert watch.has_running()
