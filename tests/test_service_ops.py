"""The operator commands' own behaviour, against a real Serve (see test_service.py for
the service they deploy)."""

from __future__ import annotations

import pytest
from ray import serve

from serve_app import service_ops
from serve_app.config import AppConfig, PoolConfig

pytestmark = pytest.mark.slow


def test_a_pool_that_cannot_be_placed_is_a_timeout_naming_the_deployment(
    ray_cluster, smollm2_dir, serve_ports
):
    # No node offers this resource: Serve would wait for ever. Deleting the app waits the
    # drain time for the replica it could not place: keep that short.
    pool = PoolConfig(resources={"baton_nowhere": 1.0}, graceful_shutdown_timeout_s=5)
    config = AppConfig(model=str(smollm2_dir), mode="aggregated", aggregated=pool)
    try:
        with pytest.raises(TimeoutError) as err:
            service_ops.deploy(
                config,
                app_name="unplaceable",
                route_prefix="/unplaceable",
                timeout_s=5,
                **serve_ports,
            )
        message = str(err.value)
        assert "'unplaceable' is not running after 5s" in message
        assert "EngineServer" in message and "fewer replicas" in message
    finally:
        # Deleted first: Serve's shutdown waits (the drain time, then gives up while its controller
        # still lives) for a replica it cannot place, and a later module's Serve would
        # connect to that dying controller.
        serve.delete("unplaceable")
        serve.shutdown()
