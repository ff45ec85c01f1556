"""`baton generate` as a user runs it: a real subprocess, stdout holds only the completion."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest
import torch
from tiny_model import make_tiny_model

from serve_app import cli, service_ops
from serve_app.cli import main
from serve_app.serve_config import APP_NAME
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def built_engines(monkeypatch) -> list[LLMEngine]:
    """The engines `baton generate --local` builds, kept for the test to inspect."""
    from workers.engine import engine as engine_module

    built: list[LLMEngine] = []

    class Recorded(LLMEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    # The CLI imports LLMEngine from this module when it runs a command.
    monkeypatch.setattr(engine_module, "LLMEngine", Recorded)
    return built


def _baton(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serve_app.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _expected_text(
    model_dir, messages=None, prompt=None, max_tokens=12, dtype="auto", **sampling
) -> str:
    """What an in-process engine writes; greedy unless `sampling` says otherwise."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype))
    ids = engine.tokenizer.encode_chat(messages) if messages else engine.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sampling})
    seq = engine.generate([ids], params)[0]
    return seq.detokenizer.text


def test_generate_prints_only_the_completion(model_dir):
    run = _baton(
        "generate", "--local", "--model", str(model_dir), "--max-tokens", "12", "Hello there"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == _expected_text(model_dir, prompt="Hello there") + "\n"
    assert "finish_reason=" in run.stderr


def test_chat_renders_the_system_and_user_messages(model_dir):
    run = _baton(
        "generate",
        "--local",
        "--model",
        str(model_dir),
        "--chat",
        "--system",
        "Be brief.",
        "--max-tokens",
        "12",
        "Hi",
    )
    assert run.returncode == 0, run.stderr
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert run.stdout == _expected_text(model_dir, messages=messages) + "\n"


def test_local_generation_without_max_tokens_fills_what_the_context_leaves(model_dir, capsys):
    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    prompt = "Hello there, " * 70
    room = engine.max_model_len - len(engine.tokenizer.encode(prompt))
    assert 0 < room < 256  # the default is then the room left, as the service's
    assert main(["generate", "--local", "--model", str(model_dir), prompt]) == 0
    expected = _expected_text(model_dir, prompt=prompt, max_tokens=room)
    assert capsys.readouterr().out == expected + "\n"


def test_seeded_sampling_is_reproducible_from_the_command_line(model_dir, capsys):
    args = ["generate", "--local", "--model", str(model_dir), "--temperature", "1.5"]
    args += ["--max-tokens", "24"]
    outputs = {}
    for seed in ("7", "7", "8"):
        assert main([*args, "--seed", seed, "Hello"]) == 0
        outputs.setdefault(seed, []).append(capsys.readouterr().out)
    assert outputs["7"][0] == outputs["7"][1] and len(outputs["7"][0]) > 1
    # The seed reached the request: it gives what an in-process engine gives for that
    # seed, and another seed gives other text (24 tokens drawn at a high temperature).
    assert (
        outputs["7"][0]
        == _expected_text(model_dir, prompt="Hello", max_tokens=24, temperature=1.5, seed=7) + "\n"
    )
    assert outputs["8"][0] != outputs["7"][0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature must be in [0, 100]"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
        (["--system", "x"], "--system needs --chat"),
    ],
)
def test_bad_arguments_exit_2_with_the_field_named(model_dir, args, message, capsys):
    assert main(["generate", "--local", "--model", str(model_dir), *args, "Hello"]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


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
    from serve_app import service_ops

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
    from serve_app.cli import DTYPES
    from serve_app.config import DType

    assert typing.get_args(DType) == DTYPES


def test_unset_flags_leave_the_services_defaults_to_apply():
    from serve_app import cli, grpc_service

    assert cli.DEFAULT_MAX_TOKENS == grpc_service.DEFAULT_MAX_TOKENS
    bare = cli._remote_request(cli._build_parser().parse_args(["generate", "hi"]), None)
    # Absent, max_tokens is 256 or the context's room if less; sent, a long prompt
    # would be refused instead.
    assert not bare.HasField("max_tokens") and not bare.HasField("seed")
    assert bare.HasField("temperature") and bare.temperature == 0.0  # the CLI's greedy
    args = ["generate", "--max-tokens", "9", "--top-k", "-1", "hi"]
    sent = cli._remote_request(cli._build_parser().parse_args(args), None)
    assert sent.max_tokens == 9 and sent.top_k == 0  # -1 is "off", as 0 in the proto


@pytest.mark.parametrize("flag", ["--seed", "--max-tokens"])
def test_a_value_the_proto_cannot_hold_is_refused_naming_its_field(flag, capsys):
    assert main(["generate", flag, "-1", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"baton: error: {flag[2:].replace('-', '_')}: Value out of range" in err


def test_local_generation_in_bfloat16(model_dir, capsys, built_engines):
    args = ["generate", "--local", "--model", str(model_dir), "--dtype", "bfloat16"]
    assert main([*args, "--max-tokens", "6", "--temperature", "0", "Hello"]) == 0
    (engine,) = built_engines
    assert engine.config.dtype == "bfloat16"
    assert {p.dtype for p in engine.runner.model.parameters()} == {torch.bfloat16}
    expected = _expected_text(model_dir, prompt="Hello", max_tokens=6, dtype="bfloat16")
    assert capsys.readouterr().out == expected + "\n"


def test_local_generation_with_speculation_writes_the_same_text(model_dir, capsys, built_engines):
    args = ["generate", "--local", "--model", str(model_dir), "--max-tokens", "30", "Hello"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative-tokens", "4"]) == 0
    assert capsys.readouterr().out == plain
    without, spec = built_engines
    assert without.config.speculative is None
    assert spec.config.speculative is not None and spec.config.speculative.num_tokens == 4
    assert spec.stats().num_draft_tokens > 0, "the speculating run drafted nothing"


@pytest.mark.parametrize("flag", [["--dtype", "bfloat16"], ["--speculative-tokens", "4"]])
def test_engine_settings_need_local(flag, capsys):
    assert main(["generate", *flag, "Hello"]) == 2
    assert "--speculative-tokens need --local" in capsys.readouterr().err


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
    from serve_app import service_ops

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
    from serve_app import node_drain

    def drain(node_id, deadline_s, address):
        return node_drain.DrainResult(node_id or "n1", serving_left, 3.0)

    monkeypatch.setattr(node_drain, "drain", drain)
    assert main(["drain", "--deadline-s", "5"]) == status
