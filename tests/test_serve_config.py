"""serve_app/serve_config.py's per-pool pieces (the whole file is checked against Serve's
schema and build_app in test_app.py and the Helm chart tests)."""

from __future__ import annotations

import pytest

from serve_app.config import AutoscalingConfig, PoolConfig
from serve_app.serve_config import pool_scale


def test_a_fixed_pool_is_its_replica_count():
    assert pool_scale(PoolConfig(num_replicas=3)) == {"num_replicas": 3}


@pytest.mark.parametrize(("start", "initial"), [(0, 2), (3, 3), (9, 5)])
def test_an_autoscaled_pool_starts_at_its_count_within_its_bounds(start, initial):
    autoscaling = AutoscalingConfig(min_replicas=2, max_replicas=5, target_ongoing_requests=8)
    scale = pool_scale(PoolConfig(num_replicas=start, autoscaling=autoscaling))
    assert scale == {
        "num_replicas": None,  # unset, over build_app's own count
        "autoscaling_config": {
            "min_replicas": 2,
            "max_replicas": 5,
            "initial_replicas": initial,
            "target_ongoing_requests": 8,
        },
    }
