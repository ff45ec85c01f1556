"""The operator commands behind `baton serve`, `baton scale`, `baton status`, `baton stop`.

They run in a short-lived driver: connect to the cluster (RAY_ADDRESS, or a local head
this module starts, marks as its own, and leaves running), act through Serve's Python
API, and exit.
Scaling redeploys the same application with one pool's replica count changed; every
deployment's version is pinned to its replicas' arguments (app.py), so Serve only adds
or drains that pool's replicas and in-flight requests carry on. It is rebuilt by a task
on the cluster, so `baton scale`, like `status` and `stop`, never imports the engine.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from pydantic import ValidationError
from ray import serve

from serve_app.code_version import source_digest
from serve_app.config import AppConfig
from serve_app.ingress import SERVE_BINARY_ENV
from serve_app.ops.ports import (
    Ingress,
    ingress_for,
    record_ingress,
    recorded_ingress,
    serve_running,
)
from serve_app.routing.registry_names import app_registry_name, remove_registry
from serve_app.serve_config import (
    APP_NAME,
    GRPC_SERVICER_FUNCTIONS,
    MAX_REQUEST_BYTES,
)
from serve_app.status_board import DEFAULT_BOARD_NAME, find_board, get_or_create_board

log = logging.getLogger("baton")

LOCAL_HEAD_MIN_CPUS = 8
# A Ray resource only heads that `baton serve` started offer: `baton stop` stops those
# and leaves any other cluster running.
LOCAL_HEAD_RESOURCE = "baton_local_head"
# Defaults of the local head's environment, where the caller's does not set them. A
# stopping router keeps serving Serve's direct-ingress draining period (30 s by default)
# for HAProxy on other nodes to drop it; on one machine HAProxy drops it at once, and the
# default would only make `baton stop` wait.
LOCAL_HEAD_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
LOCAL_DASHBOARD_HOST = "127.0.0.1"
LOCAL_DASHBOARD_PORT = 8265
# How long `deploy` waits for the application to run. Serve itself waits for ever and
# keeps retrying a replica it cannot place (or whose engine cannot start), so an
# unplaceable pool would otherwise hang `baton serve` / `baton scale` silently.
DEPLOY_TIMEOUT_S = 900.0
_DEPLOY_POLL_S = 0.5
_PROGRESS_EVERY_S = 30.0


def connect(address: str | None = None, start_if_missing: bool = False) -> None:
    """Joins RAY_ADDRESS (or `address`); with neither, a local head, started if asked."""
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address:
        ray.init(address=address, **kwargs)
        return
    try:
        ray.init(address="auto", **kwargs)
        return
    except ConnectionError:
        if not start_if_missing:
            raise ConnectionError(
                "no Ray cluster found: start one with `baton serve`, or set RAY_ADDRESS"
            ) from None
    ray_bin = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    log.info("starting a local Ray head (stop it with `baton stop`)")
    # Logical CPUs, not cores: a one-machine service's router, pools and TP ranks must
    # all be placeable even on a small box (they share its cores either way).
    num_cpus = max(os.cpu_count() or 1, LOCAL_HEAD_MIN_CPUS)
    # To a file, not a pipe: the daemons it leaves behind inherit it, and a pipe would
    # never reach EOF. Kept to say why, if it fails.
    fd, name = tempfile.mkstemp(prefix="baton-ray-start-", suffix=".log")
    output = Path(name)
    with os.fdopen(fd, "w") as out:
        started = subprocess.run(
            [
                ray_bin,
                "start",
                "--head",
                f"--num-cpus={num_cpus}",
                f'--resources={{"{LOCAL_HEAD_RESOURCE}": 1}}',
                # Ray's dashboard, on this machine's loopback only: a local head is one
                # user's, and the dashboard has no authentication.
                "--include-dashboard=true",
                f"--dashboard-host={LOCAL_DASHBOARD_HOST}",
                f"--dashboard-port={LOCAL_DASHBOARD_PORT}",
                "--disable-usage-stats",
            ],
            env={**LOCAL_HEAD_ENV, **os.environ},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if started.returncode != 0:
        lines = [ln for ln in output.read_text(errors="replace").splitlines() if ln.strip()]
        raise RuntimeError(
            f"`ray start --head` failed (exit status {started.returncode}): "
            f"{' | '.join(lines[-3:]) or 'no output'} (all of it in {output})"
        )
    ray.init(address="auto", **kwargs)
    log.info("Ray dashboard: http://%s:%d", LOCAL_DASHBOARD_HOST, LOCAL_DASHBOARD_PORT)


# Environment of the Serve controller and, by inheritance, its proxies and replicas.
# RAY_SERVE_ENABLE_HA_PROXY: each node's ingress (8000/9000) is Serve's HAProxy, which hands
# every call to a router replica's own HTTP or gRPC server (Serve's direct ingress), so no
# Python proxy handles each streamed message; RAY_SERVE_PROXY_USE_GRPC: where a Python proxy
# still serves (Serve's fallback), it reaches the routers over Serve's inter-deployment gRPC.
# bench/RESULTS.md has the figures.
# RAY_SERVE_GRPC_MAX_MESSAGE_SIZE: the client-facing gRPC servers' message limit, the
# HTTP body's (Serve's 2 GiB default would let one request stall a router for seconds).
SERVE_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(MAX_REQUEST_BYTES),
    "RAY_SERVE_PROXY_USE_GRPC": "1",
}
# The HAProxy binary Serve runs: Baton's launcher, which applies the ingress policy to
# each config Serve writes (serve_app/ingress/). Its path is this installation's; the
# Helm chart names the image's (IMAGE_HAPROXY_LAUNCHER).
HAPROXY_LAUNCHER_ENV = SERVE_BINARY_ENV
# Where the Dockerfile's install puts it: the Ray image's Python.
IMAGE_HAPROXY_LAUNCHER = "/home/ray/anaconda3/bin/baton-haproxy"


def haproxy_launcher() -> str:
    """This installation's `baton-haproxy` (beside its Python, else on PATH)."""
    found = shutil.which("baton-haproxy", path=os.path.dirname(sys.executable))
    found = found or shutil.which("baton-haproxy")
    if found is None:
        raise RuntimeError(
            "baton-haproxy (Baton's ingress launcher) is not installed beside "
            f"{sys.executable} or on PATH; reinstall Baton (scripts/setup, or pip install .)"
        )
    return os.path.abspath(found)


def serve_env() -> dict[str, str]:
    """The Serve controller's environment: SERVE_ENV and the ingress launcher."""
    return {**SERVE_ENV, HAPROXY_LAUNCHER_ENV: haproxy_launcher()}


def deploy(
    config: AppConfig,
    *,
    app_name: str = APP_NAME,
    http_port: int | None = None,
    grpc_port: int | None = None,
    http_host: str = "0.0.0.0",
    route_prefix: str = "/",
    timeout_s: float = DEPLOY_TIMEOUT_S,
) -> Ingress | None:
    """Deploys (or updates in place) the application; returns once it is running, with
    the ports its clients reach (None: Serve was started outside Baton, which alone
    knows them). Ports apply where this call starts Serve (by default 8000 and 9000); on
    a running Serve, one that differs from its ports is a ValueError (serve_app/ops/ports.py).
    TimeoutError (with Serve's view of each deployment) if it is not within `timeout_s`;
    Serve goes on trying, so the operator can wait longer or deploy a smaller config."""
    from serve_app.app import build_versioned_app

    code_version = source_digest()
    app = build_versioned_app(config, code_version)  # validates before anything starts
    board = get_or_create_board(DEFAULT_BOARD_NAME)
    running = serve_running()
    recorded = recorded_ingress(board) if running else None
    ingress = ingress_for(http_port, grpc_port, running=running, recorded=recorded)
    if not running:
        serve.start(
            http_options={"host": http_host, "port": ingress.http_port},
            grpc_options={
                "port": ingress.grpc_port,
                "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS),
            },
            # Serve's ingress per serve_env(). The Helm chart sets the same variables on
            # its pods.
            controller_options={"runtime_env": {"env_vars": serve_env()}},
        )
        record_ingress(board, ingress)
    previous = _record_and_submit(app, Deployed(config, route_prefix, code_version), app_name)
    _wait_running(app_name, timeout_s, previous)
    return ingress


def deploy_progress(app_status: Any) -> str:
    """A deploy's progress in one line, from Serve's status of the application (None:
    not created yet): each deployment's replicas by state, e.g. `Router 1 running;
    PrefillServer 1 starting`."""
    deployments = app_status.deployments if app_status is not None else {}
    if not deployments:
        return "waiting for Serve to create the deployments"
    return "; ".join(
        f"{name} "
        + (
            ", ".join(f"{n} {state.lower()}" for state, n in sorted(d.replica_states.items()))
            or "no replicas yet"
        )
        for name, d in deployments.items()
    )


def _record_and_submit(app: Any, deployed: Deployed, app_name: str) -> dict[str, Any] | None:
    """Stores how the application is deployed, then hands it to Serve without Serve's
    wait (`_wait_running` polls with a bound instead, so a timeout leaves no thread behind
    still waiting on the controller). Returns the record it replaced.

    Stored first: Serve goes on deploying after a timeout, and `baton scale` must still
    find the config then. A deploy Serve refuses leaves the last one."""
    board = get_or_create_board(DEFAULT_BOARD_NAME)
    previous = ray.get(board.config.remote(app_name))
    ray.get(board.set_config.remote(app_name, deployed.to_record()))
    try:
        serve.run_many(
            [serve.RunTarget(app, name=app_name, route_prefix=deployed.route_prefix)],
            wait_for_ingress_deployment_creation=False,
            wait_for_applications_running=False,
        )
    except Exception:
        ray.get(board.set_config.remote(app_name, previous))
        raise
    return previous


def _wait_running(app_name: str, timeout_s: float, previous: dict[str, Any] | None) -> None:
    """Waits, bounded, for the submitted application to run (Serve's own wait is for
    ever). A deploy that fails puts `previous` back as the application's record."""
    try:
        _poll_running(app_name, timeout_s)
    except TimeoutError:
        raise
    except Exception:
        board = get_or_create_board(DEFAULT_BOARD_NAME)
        ray.get(board.set_config.remote(app_name, previous))
        raise


def _poll_running(app_name: str, timeout_s: float) -> None:
    from ray.serve.schema import ApplicationStatus

    started = time.monotonic()
    deadline = started + timeout_s
    shown, shown_at = None, started
    while True:
        app_status = serve.status().applications.get(app_name)
        status = app_status.status if app_status else None
        if status == ApplicationStatus.RUNNING:
            return
        if status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"deploying application {app_name!r} failed: {app_status.message}")
        now = time.monotonic()
        if now >= deadline:
            break
        # What the wait is on (a first start loads the model in every replica), when it
        # changes and every _PROGRESS_EVERY_S while it does not.
        line = deploy_progress(app_status)
        if line != shown or now - shown_at >= _PROGRESS_EVERY_S:
            log.info("deploying %r (%.0fs): %s", app_name, now - started, line)
            shown, shown_at = line, now
        time.sleep(_DEPLOY_POLL_S)
    states = (
        "; ".join(
            f"{name}: {getattr(d.status, 'value', d.status)} {d.message}".strip()
            for name, d in app_status.deployments.items()
        )
        if app_status
        else "not created yet"
    )
    raise TimeoutError(
        f"application {app_name!r} is not running after {timeout_s:.0f}s ({states}). "
        "Serve keeps trying: check that the cluster has room for every replica and its "
        "TP ranks (`baton status`), or deploy fewer replicas or a smaller TP degree"
    )


@dataclass(frozen=True)
class Deployed:
    """What `baton serve` deployed an application with, kept for `baton scale`."""

    config: AppConfig
    route_prefix: str
    code_version: str

    def to_record(self) -> dict[str, Any]:
        return {
            "config": self.config.model_dump(mode="json"),
            "route_prefix": self.route_prefix,
            "code_version": self.code_version,
        }

    @classmethod
    def from_record(cls, app_name: str, record: dict[str, Any]) -> Deployed:
        try:
            config = AppConfig.model_validate(record["config"])
        except ValidationError as e:
            # Deployed by an earlier Baton, under rules that have changed since.
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "config"
            raise ValueError(
                f"application {app_name!r} was deployed with a config this Baton refuses "
                f"({where}: {first['msg']}); deploy it again with `baton serve`"
            ) from None
        # A record an earlier Baton kept has no code version: the current code's is used.
        return cls(config, record["route_prefix"], record.get("code_version", ""))


def _record(app_name: str) -> dict[str, Any] | None:
    return ray.get(get_or_create_board(DEFAULT_BOARD_NAME).config.remote(app_name))


def deployed(app_name: str = APP_NAME) -> Deployed | None:
    """How `baton serve` deployed the application, or None (not by `baton serve`)."""
    record = _record(app_name)
    return None if record is None else Deployed.from_record(app_name, record)


def scale(pool: str, num_replicas: int, app_name: str = APP_NAME, fixed: bool = False) -> None:
    """Sets one pool's replica count and redeploys (`rescaled` says what may change),
    with the code version it was deployed with: only that pool's replicas change. The
    application is rebuilt by a task on the cluster (`_rescale_and_submit`), so this
    driver loads no engine code."""
    if app_name not in serve.status().applications:
        raise ValueError(f"no application {app_name!r} is deployed; start it with `baton serve`")
    deployed_version = (_record(app_name) or {}).get("code_version")
    if deployed_version and deployed_version != source_digest():
        log.warning(
            "Baton's code here differs from what `baton serve` deployed: the new %s "
            "replicas load the code on their nodes, the running ones keep theirs; run "
            "`baton serve` to roll every pool onto one version",
            pool,
        )
    try:
        previous = ray.get(_rescale_and_submit.remote(pool, num_replicas, app_name, fixed))
    except ray.exceptions.RayTaskError as e:
        # The refusal itself (a ValueError naming what to do), not Ray's wrapping of it.
        raise e.cause from None
    _wait_running(app_name, DEPLOY_TIMEOUT_S, previous)


# On a cluster node, where Baton is installed with its engine (the replicas' own
# environment); one call per worker process, so the engine's modules it imported do not
# stay resident in an idle worker.
@ray.remote(num_cpus=0, max_calls=1)
def _rescale_and_submit(
    pool: str, num_replicas: int, app_name: str, fixed: bool
) -> dict[str, Any] | None:
    """`scale`'s redeploy up to Serve's wait; returns the record it replaced."""
    from serve_app.app import build_versioned_app

    current = deployed(app_name)
    if current is None:
        raise ValueError(
            f"application {app_name!r} was not deployed by `baton serve`; scale it through "
            "its Serve config instead (e.g. `helm upgrade --set prefill.replicas=N`)"
        )
    config = rescaled(current.config, pool, num_replicas, fixed)
    # A record an earlier Baton kept has no code version: the code on this node's is used.
    code_version = current.code_version or source_digest()
    app = build_versioned_app(config, code_version)
    return _record_and_submit(app, Deployed(config, current.route_prefix, code_version), app_name)


def rescaled(config: AppConfig, pool: str, num_replicas: int, fixed: bool = False) -> AppConfig:
    """`config` with one pool at `num_replicas`. An autoscaled pool is refused unless
    `fixed`, which turns its autoscaling off: a count set by hand would otherwise end the
    autoscaling silently and for good."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if pool not in config.pools():
        raise ValueError(
            f"pool must be one of {sorted(config.pools())} in {config.mode} mode, got {pool!r}"
        )
    current = getattr(config, pool)
    if current.autoscaling is not None and not fixed:
        a = current.autoscaling
        raise ValueError(
            f"the {pool} pool autoscales between {a.min_replicas} and {a.max_replicas} "
            f"replicas; `baton scale {pool} {num_replicas} --fixed` keeps it at "
            f"{num_replicas} with autoscaling off (redeploy its config to turn it back on)"
        )
    update = {"num_replicas": num_replicas, "autoscaling": None}
    return config.model_copy(update={pool: current.model_copy(update=update)})


def status(app_name: str = APP_NAME, board_name: str | None = None) -> dict[str, Any]:
    """The application's deployments (Serve's view) and its replicas' last posted stats,
    from `board_name`, else the board its `baton serve` config names, else the default
    one (a board is shared by the applications that name it)."""
    app = serve.status().applications.get(app_name)
    if app is None:
        raise ValueError(f"no application {app_name!r} is deployed; run `baton serve`")
    if board_name is None:
        # Read as stored, not validated: a config an earlier Baton kept still names it.
        record = _record(app_name) or {}
        board_name = record.get("config", {}).get("status_board_name", DEFAULT_BOARD_NAME)
    snapshots = [
        s
        for s in ray.get(get_or_create_board(board_name).snapshots.remote())
        if s["app"] == app_name
    ]
    return {
        "application": app_name,
        "status": str(app.status.value if hasattr(app.status, "value") else app.status),
        # Why it is not running (an unplaceable replica, a constructor's error), if so.
        "message": app.message,
        "deployments": {
            name: {
                "status": str(d.status.value if hasattr(d.status, "value") else d.status),
                "replicas": dict(d.replica_states),
                "message": d.message,
            }
            for name, d in app.deployments.items()
        },
        "replicas": sorted(snapshots, key=lambda s: (s["role"], s["replica_id"])),
    }


@dataclass(frozen=True)
class Stopped:
    """What `stop` took down, and whether the cluster is a head `baton serve` started on
    this machine (then `stop_local_head` goes on to stop Ray)."""

    app_deleted: bool
    apps_left: tuple[str, ...]  # other applications, which keep Serve (and Ray) running
    local_head: bool

    @property
    def serve_shut_down(self) -> bool:
        return self.app_deleted and not self.apps_left


def stop(app_name: str = APP_NAME) -> Stopped:
    """Deletes the application and its own prefix registry, and Serve too when no other
    application is left on it: a cluster joined through RAY_ADDRESS keeps its other
    applications, and Ray."""
    from serve_app.ops.node_drain import raylets

    apps = set(serve.status().applications)  # empty when Serve is not running
    if app_name in apps:
        serve.delete(app_name)  # waits until its replicas and routers are gone
    # Forgotten even where Serve had no such app (deleted by other means): a later
    # `baton scale` must not bring back what was stopped.
    board = find_board(DEFAULT_BOARD_NAME)
    record = None if board is None else ray.get(board.set_config.remote(app_name, None))
    registry = own_registry(app_name, record)
    if registry is not None and remove_registry(registry):
        log.info("removed application %r's prefix registry %r", app_name, registry)
    others = apps - {app_name}
    if apps and not others:
        serve.shutdown()
        if board is not None:
            record_ingress(board, None)
    heads = [n for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
    local = raylets()
    return Stopped(
        app_deleted=app_name in apps,
        apps_left=tuple(sorted(others)),
        local_head=any(
            LOCAL_HEAD_RESOURCE in n["Resources"] and n["NodeID"] in local for n in heads
        ),
    )


def own_registry(app_name: str, record: dict[str, Any] | None) -> str | None:
    """The prefix registry that only `app_name` uses, for `stop` to remove with it: the
    application's own, unless its `baton serve` config (`record`, as kept on the board)
    named one, which other applications may share on purpose and is left to them."""
    # Read as stored, not validated: a config an earlier Baton kept still names it.
    named = ((record or {}).get("config") or {}).get("registry_name")
    return None if named else app_registry_name(app_name)


def stop_local_head() -> None:
    """Leaves the cluster and stops this machine's Ray (`ray stop`)."""
    ray.shutdown()
    ray_bin = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    subprocess.run([ray_bin, "stop"], check=False, stdout=subprocess.DEVNULL)
