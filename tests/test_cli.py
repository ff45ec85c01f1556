"""The `baton` command's operator side (serve, status, stop, drain) and its error handling;
`baton generate` is tests/test_cli_generate.py."""

from __future__ import annotations

import subprocess
import typing
from pathlib import Path

import pytest
from tiny_model import make_tiny_model

from serve_app.ops import cli, service_ops
from serve_app.ops.cli import main
from serve_app.serve_config import APP_NAME


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError("deploying application 'baton' failed: replica crashed"),
        subprocess.CalledProcessError(1, ["ray", "start", "--head"]),
    ],
)
def test_a_failure_of_the_service_is_one_line_and_exit_1(failure, monkeypatch, capsys):
    def fail(args):
        raise failure

    monkeypatch.setitem(cli._COMMANDS, "status", fail)
    assert main(["status"]) == 1
    assert capsys.readouterr().err == f"baton: error: {failure}\n"


def test_what_ray_refuses_is_one_line_and_exit_1_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
    from ray.serve.exceptions import RayServeException

    def fail(error: BaseException):
        def command(args):
            raise error

        monkeypatch.setitem(cli._COMMANDS, "status", command)

    fail(RayServeException("Prefix / is being used by application 'baton'"))
    assert main(["status"]) == 1
    assert capsys.readouterr().err == (
        "baton: error: RayServeException: Prefix / is being used by application 'baton'\n"
    )
    fail(KeyboardInterrupt())
    assert main(["status"]) == 130
    assert capsys.readouterr().err == ""
    fail(KeyError("a bug"))
    with pytest.raises(KeyError):
        main(["status"])


@pytest.mark.parametrize(
    ("file_text", "flags", "message"),
    [
        (None, [], "nope.yaml: No such file or directory"),
        ("prefill: [1,\n", [], "not valid YAML at line 2"),
        ("- a list\n", [], "must be a mapping of AppConfig fields"),
        ("bogus: 1\n", [], "invalid configuration: bogus: Extra inputs are not permitted"),
        ("prefill: 2\n", ["--dtype", "float32"], "prefill must be a mapping of PoolConfig"),
        ("", ["--mode", "aggregated", "--prefill-replicas", "2"], "--prefill-replicas does not"),
        ("", ["--decode-tp", "5"], "decode.tensor_parallel_size=5 does not divide"),
    ],
)
def test_serve_refuses_a_bad_config_in_one_line_before_starting_ray(
    model_dir, tmp_path, capsys, monkeypatch, file_text, flags, message
):
    from serve_app.ops import service_ops

    connected = []
    monkeypatch.setattr(service_ops, "connect", lambda *a, **k: connected.append(a))
    path = tmp_path / "nope.yaml"
    if file_text is not None:
        path.write_text(file_text)
    argv = ["serve", "--config", str(path), "--model", str(model_dir), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not connected  # refused before joining or starting a Ray cluster


def test_the_dtype_choices_are_the_configs():
    from serve_app.config import DType
    from serve_app.ops.cli import DTYPES

    assert typing.get_args(DType) == DTYPES


def test_the_activations_choices_are_the_configs():
    from serve_app.config import Activations
    from serve_app.ops.cli import ACTIVATIONS

    assert typing.get_args(Activations) == ACTIVATIONS


@pytest.mark.parametrize(
    ("flags", "where"),
    [
        ([], {}),
        (["--app", "chat"], {"app_name": "chat", "route_prefix": "/chat"}),
        (["--app", "chat", "--route-prefix", "/c"], {"app_name": "chat", "route_prefix": "/c"}),
        (["--route-prefix", "/v2"], {"route_prefix": "/v2"}),
    ],
)
def test_serve_deploys_the_named_application_under_its_route_prefix(
    model_dir, monkeypatch, flags, where
):
    from serve_app.ops import service_ops

    deployed = []
    monkeypatch.setattr(service_ops, "connect", lambda *a, **k: None)
    monkeypatch.setattr(service_ops, "deploy", lambda config, **kw: deployed.append(kw))
    assert main(["serve", "--model", str(model_dir), *flags]) == 0
    (kwargs,) = deployed
    assert {k: kwargs[k] for k in ("app_name", "route_prefix") if k in kwargs} == where


@pytest.mark.parametrize(
    ("stopped", "stops_ray"),
    [
        (service_ops.Stopped(app_deleted=True, apps_left=(), local_head=True), True),
        # Joined through RAY_ADDRESS, or other applications still on Serve: Ray stays.
        (service_ops.Stopped(app_deleted=True, apps_left=(), local_head=False), False),
        (service_ops.Stopped(app_deleted=True, apps_left=("chat",), local_head=True), False),
    ],
)
def test_stop_stops_ray_only_where_baton_started_it_and_nothing_else_runs(
    monkeypatch, stopped, stops_ray
):
    stopped_ray = []
    monkeypatch.setattr(service_ops, "connect", lambda *a, **k: None)
    monkeypatch.setattr(service_ops, "stop", lambda app_name=APP_NAME: stopped)
    monkeypatch.setattr(service_ops, "stop_local_head", lambda: stopped_ray.append(True))
    assert main(["stop"]) == 0
    assert stopped_ray == ([True] if stops_ray else [])


@pytest.mark.parametrize(("serving_left", "status"), [(0, 0), (2, 1)])
def test_drain_exits_1_while_the_node_still_serves(monkeypatch, serving_left, status):
    from serve_app.ops import node_drain

    def drain(node_id, deadline_s, address):
        return node_drain.DrainResult(node_id or "n1", serving_left, 3.0)

    monkeypatch.setattr(node_drain, "drain", drain)
    assert main(["drain", "--deadline-s", "5"]) == status


def test_serve_logs_each_deployments_replicas_while_it_waits(monkeypatch, caplog):
    from types import SimpleNamespace

    from ray.serve.schema import ApplicationStatus

    def app(status, **replicas):
        deployments = {
            name: SimpleNamespace(status="UPDATING", message="", replica_states=states)
            for name, states in replicas.items()
        }
        return SimpleNamespace(status=status, message="", deployments=deployments)

    deploying = ApplicationStatus.DEPLOYING
    seen = iter(
        [
            None,
            app(deploying, Router={}, PrefillServer={}),
            app(deploying, Router={"STARTING": 1}, PrefillServer={"STARTING": 1}),
            app(deploying, Router={"STARTING": 1}, PrefillServer={"STARTING": 1}),
            app(deploying, Router={"RUNNING": 1}, PrefillServer={"STARTING": 1}),
            app(ApplicationStatus.RUNNING, Router={"RUNNING": 1}, PrefillServer={"RUNNING": 1}),
        ]
    )
    fake_serve = SimpleNamespace(
        status=lambda: SimpleNamespace(applications={"baton": a} if (a := next(seen)) else {}),
    )
    monkeypatch.setattr(service_ops, "serve", fake_serve)
    monkeypatch.setattr(service_ops, "_DEPLOY_POLL_S", 0.0)
    with caplog.at_level("INFO", logger="baton"):
        service_ops._poll_running("baton", timeout_s=60)
    lines = [r.getMessage().split(": ", 1)[1] for r in caplog.records]
    assert lines == [
        "waiting for Serve to create the deployments",
        "Router no replicas yet; PrefillServer no replicas yet",
        "Router 1 starting; PrefillServer 1 starting",  # once: it did not change
        "Router 1 running; PrefillServer 1 starting",
    ]


def test_fetch_converts_what_it_is_given_and_refuses_unknown_models_first(
    tmp_path, make_tiny_gguf, monkeypatch, capsys
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    make_tiny_gguf(gguf)
    assert main(["fetch", str(gguf), "no-such-model"]) == 2
    assert "smollm2-135m-instruct, gemma3-270m" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()  # nothing fetched before the names checked
    assert main(["fetch", str(gguf)]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder.parent == tmp_path / "cache" / "baton" / "models" / "gguf"
    assert (folder / "config.json").is_file()


@pytest.mark.parametrize(
    ("flags", "host"), [([], "0.0.0.0"), (["--host", "127.0.0.1"], "127.0.0.1")]
)
def test_serve_binds_the_apis_to_the_host_asked_for(model_dir, monkeypatch, flags, host):
    from serve_app.ops import service_ops

    deployed = []
    monkeypatch.setattr(service_ops, "connect", lambda *a, **k: None)
    monkeypatch.setattr(service_ops, "deploy", lambda config, **kw: deployed.append(kw))
    assert main(["serve", "--model", str(model_dir), *flags]) == 0
    assert deployed[0]["http_host"] == host
