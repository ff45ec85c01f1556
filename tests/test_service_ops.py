"""The operator commands' own behaviour, against a real Serve (see test_service.py for
the service they deploy)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
from ray import serve
from ray.serve.schema import ApplicationStatus, ServeDeploySchema
from service_helpers import KV, wait_for

from serve_app.config import AppConfig, AutoscalingConfig, PoolConfig
from serve_app.ops import node_drain, service_ops
from serve_app.ops.client import BatonClient, generate_request
from serve_app.ops.ports import Ingress, serve_running
from serve_app.routing.registry_names import REGISTRY_NAMESPACE, app_registry_name
from serve_app.serve_config import (
    APP_NAME,
    DEPLOYMENT_NAMES,
    GRPC_SERVICER_FUNCTIONS,
    serve_config,
)
from serve_app.status_board import DEFAULT_BOARD_NAME, get_or_create_board


@pytest.mark.slow  # a real Ray and Serve
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


def _running_replicas(board, app: str) -> set[str]:
    return {s["replica_id"] for s in ray.get(board.snapshots.remote()) if s["app"] == app}


@pytest.mark.slow  # a real Ray and Serve
def test_a_serve_config_that_rescales_one_pool_keeps_its_running_replicas(
    ray_cluster, smollm2_dir, serve_ports
):
    """The Helm chart's path: KubeRay (like `serve deploy`) hands Serve the config file.
    Adding a replica must keep the running one, not replace every replica."""
    # What `serve deploy`'s REST handler calls; there is no public Python call for it.
    from ray.serve._private.api import serve_start

    board_name = "baton-status-config-file"
    pool = PoolConfig(kv_cache_bytes=KV)
    config = AppConfig(
        model=str(smollm2_dir), mode="aggregated", aggregated=pool, status_board_name=board_name
    )
    ports = {"http_port": serve_ports["http_port"], "grpc_port": serve_ports["grpc_port"]}
    client = serve_start(
        http_options={"host": "127.0.0.1", "port": ports["http_port"]},
        grpc_options={
            "port": ports["grpc_port"],
            "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS),
        },
    )
    board = get_or_create_board(board_name)

    def deploy_and_wait(config: AppConfig, replicas: int) -> set[str]:
        client.deploy_apps(ServeDeploySchema.model_validate(serve_config(config, **ports)))

        def settled() -> set[str] | None:
            app = serve.status().applications.get(APP_NAME)
            running = _running_replicas(board, APP_NAME)
            ok = app is not None and app.status == ApplicationStatus.RUNNING
            return running if ok and len(running) == replicas else None

        return wait_for(settled, f"{replicas} running EngineServer replicas")

    try:
        (first,) = deploy_and_wait(config, 1)
        two = pool.model_copy(update={"num_replicas": 2})
        assert first in deploy_and_wait(config.model_copy(update={"aggregated": two}), 2)
        with BatonClient(f"127.0.0.1:{ports['grpc_port']}") as baton:
            request = generate_request("The capital of France is", max_tokens=4, temperature=0)
            assert baton.generate_unary(request).usage.completion_tokens == 4
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()


@pytest.mark.slow  # a real Ray and Serve
def test_deploy_starts_serve_with_its_env_and_stop_removes_only_its_application(
    ray_cluster, smollm2_dir, serve_ports, monkeypatch
):
    board_name = "baton-status-ops"  # not the default: scale and status must still find it
    config = AppConfig(
        model=str(smollm2_dir),
        mode="aggregated",
        aggregated=PoolConfig(kv_cache_bytes=KV),
        status_board_name=board_name,
    )
    started_on = Ingress(serve_ports["http_port"], serve_ports["grpc_port"])
    assert service_ops.deploy(config, **serve_ports) == started_on
    board = get_or_create_board(board_name)
    (first,) = wait_for(lambda: _running_replicas(board, APP_NAME), "the first replica")
    # Baton's code edited since `baton serve` (an editable install): scaling one pool
    # must still keep every running replica, not roll them all to a new version.
    monkeypatch.setattr(service_ops, "source_digest", lambda: "edited since")
    service_ops.scale("aggregated", 2)

    def settled() -> set[str] | None:
        # Serve done with the change (a roll would stop `first` on the way), and both
        # replicas posting.
        app = serve.status().applications[APP_NAME]
        engines = app.deployments[DEPLOYMENT_NAMES["aggregated"]].replica_states
        running = _running_replicas(board, APP_NAME)
        done = app.status == ApplicationStatus.RUNNING and engines == {"RUNNING": 2}
        return running if done and len(running) == 2 else None

    running = wait_for(settled, "2 running replicas")
    assert first in running
    assert {r["replica_id"] for r in service_ops.status()["replicas"]} == running
    # Serve's ports are the cluster's: a second application is served on them, and
    # others asked for are refused before anything is deployed.
    neighbour = {"app_name": "neighbour", "route_prefix": "/neighbour"}
    with pytest.raises(ValueError, match=rf"^grpc_port: .* grpc_port {started_on.grpc_port},"):
        service_ops.deploy(config, grpc_port=started_on.grpc_port + 1, **neighbour)
    assert "neighbour" not in serve.status().applications
    assert service_ops.deploy(config, **neighbour) == started_on
    # The proxy Serve started runs with serve_env() (it reaches the routers over gRPC).
    raylet = node_drain.raylets()[ray.get_runtime_context().get_node_id()]
    (proxy,) = [
        pid
        for pid in node_drain.serving_processes(raylet)
        if "ProxyActor" in " ".join(node_drain.cmdline(pid))
    ]
    environ = Path(f"/proc/{proxy}/environ").read_bytes().split(b"\0")
    for name, value in service_ops.serve_env().items():
        assert f"{name}={value}".encode() in environ

    # The session's Ray was started by pytest, not `baton serve`: it stays, and so does
    # the neighbouring application, until it is the last one.
    stopped = service_ops.stop()
    assert stopped == service_ops.Stopped(
        app_deleted=True, apps_left=("neighbour",), local_head=False
    )
    assert not stopped.serve_shut_down
    assert set(serve.status().applications) == {"neighbour"}
    # Each application had a prefix registry of its own; only the stopped one's went.
    wait_for(lambda: not _registry_exists(APP_NAME), "the stopped application's registry to go")
    assert _registry_exists("neighbour")
    # What was stopped stays stopped: scale refuses rather than deploying it again.
    assert service_ops.deployed() is None
    with pytest.raises(ValueError, match="no application 'baton' is deployed"):
        service_ops.scale("aggregated", 1)
    stopped = service_ops.stop("neighbour")
    assert stopped == service_ops.Stopped(app_deleted=True, apps_left=(), local_head=False)
    assert stopped.serve_shut_down
    assert not serve.status().applications and not serve_running()
    assert ray.get(get_or_create_board(DEFAULT_BOARD_NAME).ingress.remote()) is None
    wait_for(lambda: not _registry_exists("neighbour"), "the neighbour's registry to go")
    stopped = service_ops.stop()
    assert stopped == service_ops.Stopped(app_deleted=False, apps_left=(), local_head=False)
    assert not stopped.serve_shut_down
    assert ray.is_initialized() and ray.cluster_resources()["CPU"] == 16


def _registry_exists(app: str) -> bool:
    try:
        ray.get_actor(app_registry_name(app), namespace=REGISTRY_NAMESPACE)
    except ValueError:
        return False
    return True


def test_stop_removes_the_applications_own_registry_but_not_a_named_one():
    assert service_ops.own_registry("a", None) == app_registry_name("a")
    assert service_ops.own_registry("a", {"config": {}}) == app_registry_name("a")
    unnamed = {"config": {"registry_name": None}, "route_prefix": "/"}
    assert service_ops.own_registry("a", unnamed) == app_registry_name("a")
    # Named (perhaps shared with other applications, as an earlier Baton's default was).
    for name in ("shared-prefixes", "baton-prefix-registry"):
        assert service_ops.own_registry("a", {"config": {"registry_name": name}}) is None


@pytest.mark.parametrize(
    ("record", "removed"),
    [
        (None, [app_registry_name("second")]),
        ({"config": {}, "route_prefix": "/second"}, [app_registry_name("second")]),
        ({"config": {"registry_name": "shared"}, "route_prefix": "/second"}, []),
    ],
)
def test_stopping_an_application_removes_its_registry_after_the_application(
    monkeypatch, record, removed
):
    # Serve, the board and Ray stood in for: the order of what `stop` does.
    events = []
    apps = {"baton": None, "second": None}
    monkeypatch.setattr(
        service_ops.serve, "status", lambda: SimpleNamespace(applications=dict(apps))
    )
    monkeypatch.setattr(service_ops.serve, "delete", lambda name: events.append(("delete", name)))
    monkeypatch.setattr(service_ops.serve, "shutdown", lambda: events.append(("shutdown",)))

    def set_config(app_name, config):
        events.append(("forget", app_name))
        return record

    board = SimpleNamespace(set_config=SimpleNamespace(remote=set_config))
    monkeypatch.setattr(service_ops, "find_board", lambda name: board)
    monkeypatch.setattr(service_ops.ray, "get", lambda ref: ref)
    monkeypatch.setattr(service_ops.ray, "nodes", lambda: [])
    monkeypatch.setattr(node_drain, "raylets", lambda: {})
    monkeypatch.setattr(
        service_ops, "remove_registry", lambda name: events.append(("remove", name)) or True
    )
    stopped = service_ops.stop("second")
    assert stopped == service_ops.Stopped(app_deleted=True, apps_left=("baton",), local_head=False)
    assert events == [("delete", "second"), ("forget", "second")] + [
        ("remove", name) for name in removed
    ]


@pytest.mark.parametrize("own", [None, "45"])
def test_the_local_head_drains_routers_briefly_unless_told_otherwise(monkeypatch, own):
    # No cluster to join: connect starts `ray start --head` (recorded here, not run).
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    name = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
    monkeypatch.delenv(name, raising=False)
    if own is not None:
        monkeypatch.setenv(name, own)
    joins, starts = [], []

    def init(address, **kwargs):
        joins.append(address)
        if len(joins) == 1:
            raise ConnectionError("no cluster")

    monkeypatch.setattr(service_ops.ray, "init", init)

    def run(argv, **kwargs):
        starts.append((argv, kwargs))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(service_ops.subprocess, "run", run)
    service_ops.connect(start_if_missing=True)
    ((argv, kwargs),) = starts
    assert argv[1:3] == ["start", "--head"] and joins == ["auto", "auto"]
    assert kwargs["env"][name] == (own or service_ops.LOCAL_HEAD_ENV[name])


def test_a_local_head_that_fails_to_start_says_why(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def init(address, **kwargs):
        raise ConnectionError("no cluster")

    def run(argv, stdout, **kwargs):
        stdout.write("Usage stats collection is disabled.\n\n")
        stdout.write("ConnectionError: port 6379 is already in use\n")
        return subprocess.CompletedProcess(argv, 1)

    monkeypatch.setattr(service_ops.ray, "init", init)
    monkeypatch.setattr(service_ops.subprocess, "run", run)
    with pytest.raises(RuntimeError) as err:
        service_ops.connect(start_if_missing=True)
    assert str(err.value).startswith(
        "`ray start --head` failed (exit status 1): Usage stats collection is disabled. | "
        "ConnectionError: port 6379 is already in use (all of it in "
    )


def test_rescaling_an_autoscaled_pool_needs_fixed_which_turns_its_autoscaling_off():
    autoscaling = AutoscalingConfig(min_replicas=1, max_replicas=4)
    config = AppConfig(decode=PoolConfig(autoscaling=autoscaling))
    with pytest.raises(ValueError) as err:
        service_ops.rescaled(config, "decode", 6)
    assert "autoscales between 1 and 4" in str(err.value)
    assert "baton scale decode 6 --fixed" in str(err.value)
    fixed = service_ops.rescaled(config, "decode", 6, fixed=True)
    assert fixed.decode.num_replicas == 6 and fixed.decode.autoscaling is None
    assert fixed.prefill == config.prefill
    # A pool with a fixed count needs no flag; a pool the mode lacks and a count below one
    # are refused naming what is allowed.
    assert service_ops.rescaled(config, "prefill", 3).prefill.num_replicas == 3
    with pytest.raises(ValueError, match=r"one of \['decode', 'prefill'\]"):
        service_ops.rescaled(config, "aggregated", 2)
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        service_ops.rescaled(config, "prefill", 0)


def test_a_config_an_earlier_baton_kept_that_this_one_refuses_says_to_redeploy():
    record = {"config": {"decode": {"max_num_batched_tokens": 32}}, "route_prefix": "/"}
    with pytest.raises(ValueError) as err:
        service_ops.Deployed.from_record("baton", record)
    assert str(err.value).startswith(
        "application 'baton' was deployed with a config this Baton refuses (decode: Value "
        "error, max_num_batched_tokens (32) must be >= max_num_seqs (64)"
    )
    assert str(err.value).endswith("deploy it again with `baton serve`")
    # A record of an earlier Baton, without a code version, is read with none.
    record = {"config": {}, "route_prefix": "/v2"}
    assert service_ops.Deployed.from_record("baton", record).code_version == ""
