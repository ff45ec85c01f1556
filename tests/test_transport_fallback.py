"""serve_app/handoff/transport_fallback.py: a run of failed direct pulls pauses them a while."""

from __future__ import annotations

import pytest

from serve_app.handoff.transport_fallback import TransportFallback
from workers.kv.transport import KVTransferError

FAILED = KVTransferError("NIXL_ERR_REMOTE_DISCONNECT")


class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _fail(fallback: TransportFallback, clock: _Clock) -> None:
    """A pull that starts now and fails a moment later."""
    started = clock.now
    clock.now += 0.01
    fallback.direct_pull_failed(FAILED, started)


def test_a_run_of_failures_pauses_direct_pulls_for_a_while():
    clock = _Clock()
    fallback = TransportFallback(failures_to_pause=3, pause_s=60.0, clock=clock)
    for _ in range(2):
        _fail(fallback, clock)
        assert fallback.transport() is None
    _fail(fallback, clock)
    assert fallback.transport() == "object_store" and fallback.num_pauses == 1
    clock.now += 59.9
    assert fallback.transport() == "object_store"
    clock.now += 0.2
    assert fallback.transport() is None  # direct pulls are tried again


def test_a_success_between_failures_breaks_the_run():
    clock = _Clock()
    fallback = TransportFallback(failures_to_pause=2, clock=clock)
    _fail(fallback, clock)
    fallback.direct_pull_succeeded()
    _fail(fallback, clock)
    assert fallback.transport() is None and fallback.num_pauses == 0
    _fail(fallback, clock)
    assert fallback.transport() == "object_store"


def test_pulls_that_fail_together_count_once():
    # A prefill replica that dies fails every pull in flight from it at once: one cause.
    clock = _Clock()
    fallback = TransportFallback(failures_to_pause=3, clock=clock)
    started = clock.now
    clock.now += 0.5
    for _ in range(5):
        fallback.direct_pull_failed(FAILED, started)
    assert fallback.transport() is None and fallback.num_pauses == 0
    _fail(fallback, clock)
    _fail(fallback, clock)  # the third failure in a row, each pull begun after the last
    assert fallback.transport() == "object_store"


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"failures_to_pause": 0}, "failures_to_pause"), ({"pause_s": 0.0}, "pause_s")],
)
def test_bad_settings_name_the_field(kwargs, named):
    with pytest.raises(ValueError, match=named):
        TransportFallback(**kwargs)
