"""`baton generate` as a user runs it: a real subprocess, stdout holds only the completion
(serve_app/ops/generate.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tiny_model import make_tiny_model

from serve_app.ops import cli
from serve_app.ops import generate as cli_generate
from serve_app.ops.cli import main
from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def built_engines(monkeypatch) -> list[LLMEngine]:
    """The engines `baton generate --local` builds, kept for the test to inspect."""
    import workers.engine as engine_module

    built: list[LLMEngine] = []

    class Recorded(LLMEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    # The CLI imports LLMEngine from the engine package when it runs a command.
    monkeypatch.setattr(engine_module, "LLMEngine", Recorded)
    return built


def _baton(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serve_app.ops.cli", *args],
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


def test_unset_flags_leave_the_services_defaults_to_apply():
    from serve_app.grpc import service as grpc_service

    assert cli_generate.DEFAULT_MAX_TOKENS == grpc_service.DEFAULT_MAX_TOKENS
    bare = cli_generate._remote_request(cli._build_parser().parse_args(["generate", "hi"]), None)
    # Absent, max_tokens is 256 or the context's room if less; sent, a long prompt
    # would be refused instead.
    assert not bare.HasField("max_tokens") and not bare.HasField("seed")
    assert bare.HasField("temperature") and bare.temperature == 0.0  # the CLI's greedy
    args = ["generate", "--max-tokens", "9", "--top-k", "-1", "hi"]
    sent = cli_generate._remote_request(cli._build_parser().parse_args(args), None)
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


def test_local_generation_takes_the_activations_and_tells_a_model_without_blocks(
    model_dir, capsys, caplog, built_engines
):
    args = ["generate", "--local", "--model", str(model_dir), "--max-tokens", "4", "Hello"]
    with caplog.at_level("INFO"):
        assert main([*args, "--activations", "int8"]) == 0
    # The tiny test model is float32 safetensors: nothing to take 8-bit input.
    assert "8 bits" in caplog.text
    assert capsys.readouterr().out
    assert main([*args, "--activations", "int16"]) == 0
    assert main(args) == 0
    assert [e.config.activations for e in built_engines] == ["int8", "int16", "exact"]
    assert EngineConfig(model=str(model_dir)).activations == "exact"  # unset: the default


def test_unknown_activations_are_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        cli._build_parser().parse_args(["generate", "--local", "--activations", "int4", "Hi"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --activations: invalid choice: 'int4'" in error
    assert all(choice in error for choice in ("exact", "int16", "int8"))


@pytest.mark.parametrize(
    "flag",
    [["--dtype", "bfloat16"], ["--speculative-tokens", "4"], ["--activations", "exact"]],
)
def test_engine_settings_need_local(flag, capsys):
    assert main(["generate", *flag, "Hello"]) == 2
    assert "--activations need --local" in capsys.readouterr().err


def test_model_help_names_every_bundled_model():
    from serve_app.ops.cli import MODEL_HELP
    from workers.model import BUNDLED_MODELS

    assert all(name in MODEL_HELP for name in BUNDLED_MODELS)
