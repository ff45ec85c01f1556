"""The `baton` commands that only talk to a running service (generate over gRPC, status,
stop) load no engine code: run where torch cannot be imported, they still work up to
where they would reach the service (serve_app/ops/; speed is bench/cli.py's)."""

from __future__ import annotations

import copy

from no_torch import run_without_torch

from serve_app.ops import cli

_ENGINE = ("torch", "workers.engine", "workers.model", "workers.runner")


# Printed last by each program: the engine modules it loaded (none, it should say).
_LOADED_ENGINE_MODULES = f"""
print("ENGINE", sorted(m for m in sys.modules if m.startswith({_ENGINE!r})))
"""


def test_the_blocker_does_block_torch():
    run = run_without_torch("import torch\n")
    assert run.returncode == 1 and "torch is not importable in this test" in run.stderr


def test_help_and_generate_up_to_the_connection_need_no_torch():
    code = """
        import contextlib, io
        from serve_app.ops.cli import main

        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                main(["--help"])
            except SystemExit as e:
                assert e.code == 0, e.code
        assert "generate" in out.getvalue()
        # Nothing listens on port 1: the call fails where it would reach the service.
        print("RC", main(["generate", "--address", "127.0.0.1:1", "--max-tokens", "1", "x"]))
        """
    run = run_without_torch(code, _LOADED_ENGINE_MODULES)
    assert "RC 1" in run.stdout, run.stderr
    assert "ENGINE []" in run.stdout, run.stdout
    assert "baton: UNAVAILABLE: " in run.stderr and "127.0.0.1:1" in run.stderr
    assert "ImportError" not in run.stderr and "Traceback" not in run.stderr


def test_bench_needs_no_torch():
    # Nothing listens on port 1: every request fails, and is counted as failed.
    run = run_without_torch(
        """
        from serve_app.ops.cli import main
        args = ["bench", "--base-url", "http://127.0.0.1:1/v1", "--model", "m", "--warmup", "0"]
        print("RC", main([*args, "--num-prompts", "2", "--concurrency", "1", "--no-progress"]))
        """,
        _LOADED_ENGINE_MODULES,
    )
    assert "RC 0" in run.stdout and "ENGINE []" in run.stdout, run.stderr
    assert '"requests_sent": 2' in run.stdout and '"requests_failed": 2' in run.stdout


def test_a_bad_flag_for_the_remote_generate_is_refusedrun_without_torch():
    run = run_without_torch(
        """
        from serve_app.ops.cli import main
        print("RC", main(["generate", "--seed", "-1", "x"]))
        """,
        _LOADED_ENGINE_MODULES,
    )
    assert "RC 2" in run.stdout and "ENGINE []" in run.stdout, run.stderr
    assert "baton: error: seed: Value out of range" in run.stderr


def test_status_and_stop_read_serves_statusrun_without_torch():
    # What `baton status` and `stop` import, and Serve's own reading of its status with a
    # Baton router's config in it: Serve imports that router's module to validate it, so
    # the module (and serve_app.protocol under it) must not load the engine.
    code = f"""
        from ray.serve.schema import ServeInstanceDetails

        from serve_app.ops import cli, service_ops, status_text
        from serve_app.ops.serve_args import app_config_from_args

        status = ServeInstanceDetails(**{_details()!r})._get_status()
        assert status.applications["baton"].deployments["Router"].replica_states == {{
            "RUNNING": 1
        }}, status
        print("STATUS", status.applications["baton"].status.value)
        """
    run = run_without_torch(code, _LOADED_ENGINE_MODULES)
    assert "STATUS RUNNING" in run.stdout, run.stderr
    assert "ENGINE []" in run.stdout, run.stdout


def _details(router_class: str = "serve_app.routing.request_router:KVAwareRequestRouter"):
    """The Serve controller's details (`get_serve_details()`) of one application whose
    router deployment names `router_class`."""
    router_config = {"request_router_class": router_class}
    deployment = {"name": "Router", "request_router_config": router_config}
    return {
        "controller_info": {},
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": 8000},
        "grpc_options": {"port": 9000},
        "proxies": {},
        "applications": {
            "baton": {
                "name": "baton",
                "route_prefix": "/",
                "docs_path": None,
                "status": "RUNNING",
                "message": "",
                "last_deployed_time_s": 1.0,
                "source": "imperative",
                "external_scaler_enabled": False,
                "deployed_app_config": {
                    "name": "baton",
                    "import_path": "serve_app.app:build_app",
                    "deployments": [copy.deepcopy(deployment)],
                },
                "deployments": {
                    "Router": {
                        "name": "Router",
                        "status": "HEALTHY",
                        "status_trigger": "CONFIG_UPDATE_COMPLETED",
                        "message": "",
                        "deployment_config": copy.deepcopy(deployment),
                        "target_num_replicas": 1,
                        "required_resources": {"CPU": 0.5},
                        "replicas": [
                            {
                                "node_id": None,
                                "node_ip": None,
                                "node_instance_id": None,
                                "actor_id": None,
                                "actor_name": "SERVE_REPLICA::baton#Router#a",
                                "worker_id": None,
                                "log_file_path": None,
                                "replica_id": "a",
                                "state": "RUNNING",
                                "pid": None,
                                "start_time_s": 1.0,
                            }
                        ],
                    }
                },
            }
        },
    }


def test_a_model_fetch_error_is_still_one_line_and_exit_2(monkeypatch, capsys):
    from workers.model import ModelFetchError

    def fail(args):
        raise ModelFetchError("could not fetch the bundled model: offline")

    monkeypatch.setitem(cli._COMMANDS, "status", fail)
    assert cli.main(["status"]) == 2
    assert capsys.readouterr().err == "baton: error: could not fetch the bundled model: offline\n"
