"""serve_app/ops/ports.py: which ports a deploy's clients reach, and the ports refused on a
running Serve (the whole path, with a real Serve, runs in test_service_ops.py)."""

from __future__ import annotations

import pytest
import ray

from serve_app.ops.ports import Ingress, ingress_for, record_ingress, recorded_ingress
from serve_app.serve_config import GRPC_PORT, HTTP_PORT
from serve_app.status_board import StatusBoard


def test_serve_not_running_starts_on_the_ports_asked_for_or_the_defaults():
    assert ingress_for(None, None, running=False, recorded=None) == Ingress(HTTP_PORT, GRPC_PORT)
    assert ingress_for(8100, None, running=False, recorded=None) == Ingress(8100, GRPC_PORT)
    # A record left from a Serve that has stopped since says nothing about the next one.
    stale = Ingress(8100, 9100)
    assert ingress_for(None, 9200, running=False, recorded=stale) == Ingress(HTTP_PORT, 9200)


def test_a_running_serve_keeps_its_ports():
    running = Ingress(8100, 9100)
    assert ingress_for(None, None, running=True, recorded=running) == running
    assert ingress_for(8100, 9100, running=True, recorded=running) == running


@pytest.mark.parametrize(
    ("asked", "field", "serving"),
    [((None, 9000), "grpc_port", 9100), ((8000, None), "http_port", 8100)],
)
def test_other_ports_than_a_running_serves_are_refused_naming_the_field(asked, field, serving):
    with pytest.raises(ValueError) as err:
        ingress_for(*asked, running=True, recorded=Ingress(8100, 9100))
    message = str(err.value)
    assert message.startswith(f"{field}: Serve already runs on this cluster with {field} {serving}")
    assert f"--{field.replace('_', '-')}" in message and "baton stop" in message


def test_serve_started_outside_baton_has_ports_only_its_config_knows():
    assert ingress_for(None, None, running=True, recorded=None) is None
    # Nothing to compare against: the deploy goes ahead and says where to look.
    assert ingress_for(8000, 9000, running=True, recorded=None) is None


def test_the_board_record_round_trips():
    ingress = Ingress(8100, 9100)
    assert Ingress.from_record(ingress.to_record()) == ingress
    assert Ingress.from_record(None) is None


@pytest.mark.slow  # a real Ray
def test_the_board_keeps_the_ports_and_an_earlier_batons_board_has_none(ray_cluster):
    board = ray.remote(StatusBoard).options(num_cpus=0).remote()
    assert recorded_ingress(board) is None
    record_ingress(board, Ingress(8100, 9100))
    assert recorded_ingress(board) == Ingress(8100, 9100)
    record_ingress(board, None)
    assert recorded_ingress(board) is None

    class EarlierBoard:  # detached boards outlive upgrades: one without the ports
        def config(self, app_name: str) -> None:
            return None

    earlier = ray.remote(EarlierBoard).options(num_cpus=0).remote()
    record_ingress(earlier, Ingress(8100, 9100))  # nowhere to keep them: not an error
    assert recorded_ingress(earlier) is None
    ray.kill(board)
    ray.kill(earlier)
