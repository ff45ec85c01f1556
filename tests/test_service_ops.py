"""The operator commands' own behaviour, against a real Serve (see test_service.py for
the service they deploy)."""

from __future__ import annotations

import socket

import pytest
from ray import serve

from serve_app import service_ops
from serve_app.config import AppConfig, PoolConfig

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_pool_that_cannot_be_placed_is_a_timeout_naming_the_deployment(ray_cluster, smollm2_dir):
    # No node offers this resource: Serve would wait for ever.
    pool = PoolConfig(resources={"baton_nowhere": 1.0})
    config = AppConfig(model=str(smollm2_dir), mode="aggregated", aggregated=pool)
    ports = {"http_port": _free_port(), "grpc_port": _free_port(), "http_host": "127.0.0.1"}
    try:
        with pytest.raises(TimeoutError) as err:
            service_ops.deploy(
                config, app_name="unplaceable", route_prefix="/unplaceable", timeout_s=5, **ports
            )
        message = str(err.value)
        assert "'unplaceable' is not running after 5s" in message
        assert "EngineServer" in message and "fewer replicas" in message
    finally:
        serve.shutdown()
