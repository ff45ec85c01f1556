"""cluster.yaml (the Ray cluster launcher config) passes Ray's own checks, broken copies do not,
and its node types, app args and `baton serve` command agree with each other and the chart."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from serve_app.config import AppConfig
from serve_app.ops.cli import _build_parser

REPO = Path(__file__).resolve().parents[1]
POOL_NODE_TYPES = {"prefill": "prefill_gpu", "decode": "decode_gpu"}


@pytest.fixture
def config() -> dict[str, Any]:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def _check(config: dict[str, Any]) -> dict[str, Any]:
    """What `ray up` does to the file before launching anything."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_ray_accepts_the_config(config):
    prepared = _check(config)
    assert prepared["provider"]["type"] == "aws"
    assert set(prepared["available_node_types"]) == {"head", *POOL_NODE_TYPES.values()}


def _without_provider(c):
    del c["provider"]


def _bad_head_type(c):
    c["head_node_type"] = "gpu_head"


def _negative_max_workers(c):
    c["max_workers"] = -1


def _fractional_resource(c):
    c["available_node_types"]["prefill_gpu"]["resources"]["baton_prefill"] = 0.5


def _unknown_node_type_key(c):
    c["available_node_types"]["decode_gpu"]["max_worker"] = 3


def _min_workers_over_max(c):
    c["available_node_types"]["prefill_gpu"]["min_workers"] = c["max_workers"] + 1


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (_without_provider, "provider"),
        (_bad_head_type, "head_node_type"),
        (_negative_max_workers, "-1 is less than the minimum of 0"),
        (_fractional_resource, "0.5 is not of type 'integer'"),
        (_unknown_node_type_key, "max_worker"),
        (_min_workers_over_max, "max_workers"),
    ],
)
def test_ray_rejects_a_broken_copy(config, breakage, expected):
    breakage(config)
    with pytest.raises((KeyError, ValueError, jsonschema.ValidationError)) as caught:
        _check(config)
    assert expected in str(caught.value)


def test_node_types_offer_the_charts_resources(config):
    values = yaml.safe_load((REPO / "helm" / "values.yaml").read_text())
    types = config["available_node_types"]
    for pool, node_type in POOL_NODE_TYPES.items():
        name = values[pool]["rayResource"]
        resources = types[node_type]["resources"]
        assert resources[name] == 1, (node_type, resources)
        assert resources["GPU"] >= 1 and resources["CPU"] >= 1
        others = [t for t in types if t != node_type]
        assert all(name not in types[t]["resources"] for t in others)


def _app_args(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The file the head's setup writes and the AppConfig args in it."""
    (command,) = [c for c in config["head_setup_commands"] if "baton-app" in c]
    match = re.fullmatch(r"printf '%s\\n' '(?P<json>\{.*\})'\s*> (?P<path>\S+)", command)
    assert match, command
    return match["path"], json.loads(match["json"])


def test_app_args_fit_the_node_types(config):
    _, args = _app_args(config)
    app = AppConfig.model_validate(args)
    types = config["available_node_types"]
    assert set(app.pools()) == set(POOL_NODE_TYPES)
    for role, pool in app.pools().items():
        node = types[POOL_NODE_TYPES[role]]
        (name,) = pool.resources
        # One replica per node: the node offers exactly what one replica asks for.
        assert pool.resources[name] == node["resources"][name] == 1
        ranks = pool.tensor_parallel_size if pool.tensor_parallel_size > 1 else 0
        assert pool.num_cpus + ranks <= node["resources"]["CPU"]
        assert max(pool.num_gpus, ranks) <= node["resources"]["GPU"]
        assert pool.autoscaling is not None
        assert pool.autoscaling.min_replicas <= node["min_workers"]
        assert pool.autoscaling.max_replicas <= node["max_workers"]
    assert sum(types[t]["max_workers"] for t in POOL_NODE_TYPES.values()) <= config["max_workers"]
    # Routers ask for a resource the head alone offers, and the head has their CPUs.
    (name,) = app.router.resources
    assert [t for t in types if name in types[t]["resources"]] == [config["head_node_type"]]
    head = types[config["head_node_type"]]["resources"]
    assert app.router.num_replicas * app.router.num_cpus <= head["CPU"]


def test_head_runs_baton_serve_on_the_written_args(config):
    path, _ = _app_args(config)
    serve = config["head_start_ray_commands"][-1]
    argv = shlex.split(serve)
    assert argv[:2] == ["baton", "serve"]
    # Ray is started first, then the app is deployed into it.
    assert any("ray start --head" in c for c in config["head_start_ray_commands"][:-1])
    parsed = _build_parser().parse_args(argv[1:])
    assert vars(parsed)["address"] == "auto"
    assert vars(parsed)["config"] == path


def test_only_cpu_nodes_pin_torch(config):
    head = " ".join(config["head_setup_commands"])
    workers = " ".join(config["setup_commands"] + config["worker_setup_commands"])
    # The CPU head pins the CPU wheel; GPU nodes let pip pick torch's CUDA build.
    assert '"torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu' in head
    assert "torch" not in workers
    assert "pip install -q ~/baton" in workers
