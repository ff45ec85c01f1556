"""How the Helm chart's Ray pods start and stop: the environment and volumes every Ray
container gets (values.volumes, a memory-backed /dev/shm for Ray's object store), the API
keys they receive from a Secret, and the worker pods' stop, which drains the pod's Serve
replica (`baton drain`) within the grace period."""

from __future__ import annotations

import shlex

import pytest
from helm_chart_helpers import (
    MODEL_VOLUME,
    _groups,
    _merged,
    _rayservice,
    _render,
    _serve_config,
    value_sets,
)

from serve_app.ops.cli import _build_parser
from serve_app.ops.service_ops import HAPROXY_LAUNCHER_ENV, IMAGE_HAPROXY_LAUNCHER, SERVE_ENV

# What the chart sets on every Ray pod, as service_ops.serve_env() where Baton starts Serve.
CHART_ENV = dict(sorted({**SERVE_ENV, HAPROXY_LAUNCHER_ENV: IMAGE_HAPROXY_LAUNCHER}.items()))


def _pods(rayservice: dict) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    pods = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    pods.update({role: g["template"]["spec"] for role, g in _groups(rayservice).items()})
    return pods


def _pre_stop(pod: dict) -> str:
    (container,) = pod["containers"]
    shell, flag, command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert (shell, flag) == ("/bin/sh", "-c")
    return command


@value_sets
def test_every_ray_pod_mounts_the_volumes_and_a_memory_backed_dev_shm(chart, values):
    merged = _merged(chart, values)
    for role, pod in _pods(_rayservice(_render(chart, values))).items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        shm = volumes[mounts.pop("/dev/shm")]["emptyDir"]
        assert shm["medium"] == "Memory", role
        assert shm.get("sizeLimit") == merged["sharedMemory"].get("sizeLimit"), role
        mounts = {path: name for path, name in mounts.items() if name != "api-keys"}
        assert mounts == {m["mountPath"]: m["name"] for m in merged["volumeMounts"]}
        ours = ("dshm", "api-keys")  # the next tests look at the API keys' volume
        assert [v for n, v in volumes.items() if n not in ours] == merged["volumes"]


@value_sets
def test_every_ray_container_gets_serves_environment_then_the_values_env(chart, values):
    # The proxies, on any serving pod, read it when Serve starts them (service_ops.SERVE_ENV).
    merged = _merged(chart, values)
    serve_env = [{"name": name, "value": value} for name, value in CHART_ENV.items()]
    for role, pod in _pods(_rayservice(_render(chart, values))).items():
        (container,) = pod["containers"]
        assert container["env"] == serve_env + merged["env"], role


@pytest.mark.parametrize("name", sorted(CHART_ENV))
def test_the_values_env_may_set_each_of_serves_variables_itself(chart, name):
    own = [{"name": name, "value": "0"}]
    rest = [{"name": n, "value": v} for n, v in CHART_ENV.items() if n != name]
    for role, pod in _pods(_rayservice(_render(chart, {"env": own}))).items():
        (container,) = pod["containers"]
        assert container["env"] == rest + own, role


@value_sets
def test_the_api_keys_secret_is_mounted_where_the_router_reads_it(chart, values):
    merged = _merged(chart, values)
    rayservice = _rayservice(_render(chart, values))
    (app,) = _serve_config(rayservice)["applications"]
    secret = merged["apiKey"]
    for pod in _pods(rayservice).values():
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["name"]: m for m in pod["containers"][0].get("volumeMounts", [])}
        if not secret["secretName"]:
            assert "api-keys" not in volumes and "api_key_file" not in app["args"]
            continue
        # The Serve config names the file, never a key; a whole-volume mount (no
        # subPath), which the kubelet updates in place when the Secret changes.
        mount = mounts["api-keys"]
        assert "subPath" not in mount and mount["readOnly"] is True
        source = volumes["api-keys"]["secret"]
        (item,) = source["items"]
        assert source["secretName"] == secret["secretName"]
        assert item["key"] == secret["secretKey"]
        assert app["args"]["api_key_file"] == f"{mount['mountPath']}/{item['path']}"


def test_shared_memory_can_be_left_to_kubernetes(chart):
    values = {"sharedMemory": {"enabled": False}}
    for pod in _pods(_rayservice(_render(chart, values))).values():
        assert "volumes" not in pod
        assert "volumeMounts" not in pod["containers"][0]


@value_sets
def test_a_stopping_worker_drains_its_replica_within_the_grace_period(chart, values):
    merged = _merged(chart, values)
    pods = _pods(_rayservice(_render(chart, values)))
    # The head hosts no engine replica: Ray leaves at once.
    assert _pre_stop(pods.pop("head")) == "ray stop"
    for role, pod in pods.items():
        pool = merged[role]
        grace = pool.get("terminationGracePeriodSeconds")  # Helm drops a null
        if grace is None:  # time for a replacement to start, then for the streams to end
            grace = int(pool["replica"]["gracefulShutdownTimeoutS"]) + 60
        assert pod["terminationGracePeriodSeconds"] == grace
        drain, stop = _pre_stop(pod).split("; ")
        assert stop == "ray stop"  # drained or not, Ray leaves before the SIGKILL
        *command, to_log, errors_too = shlex.split(drain)
        assert (to_log, errors_too) == (">/proc/1/fd/1", "2>&1")  # into the pod's log
        args = _build_parser().parse_args(command[1:])
        assert (args.command, args.node_id, args.address) == ("drain", None, None)
        assert args.deadline_s == grace - 10


def test_one_pool_may_take_longer_to_stop(chart):
    pods = _pods(_rayservice(_render(chart, MODEL_VOLUME)))
    assert pods["decode"]["terminationGracePeriodSeconds"] == 600
    assert pods["prefill"]["terminationGracePeriodSeconds"] == 180
