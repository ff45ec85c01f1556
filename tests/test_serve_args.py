"""`baton serve`'s configuration from a file and flags (serve_app/ops/serve_args.py); its
refusals, as the command reports them, are in test_cli.py."""

from __future__ import annotations

import pytest

from serve_app.ops.cli import _build_parser
from serve_app.ops.serve_args import app_config_from_args


def test_serve_flags_override_the_config_file(model_dir, tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text(
        f"model: {model_dir}\n"
        "prefill:\n  num_replicas: 3\n  num_threads: 2\n  dtype: float32\n"
        "decode:\n"  # an empty pool key loads as None
    )
    args = _build_parser().parse_args(
        ["serve", "--config", str(path), "--decode-tp", "3", "--dtype", "bfloat16"]
    )
    config = app_config_from_args(args)
    assert (config.prefill.num_replicas, config.prefill.num_threads) == (3, 2)
    assert config.decode.tensor_parallel_size == 3
    assert {config.prefill.dtype, config.decode.dtype, config.aggregated.dtype} == {"bfloat16"}


def test_threads_apply_to_every_pool_and_are_checked(model_dir):
    args = _build_parser().parse_args(
        ["serve", "--model", str(model_dir), "--mode", "aggregated", "--threads", "2"]
    )
    config = app_config_from_args(args)
    assert config.aggregated.num_threads == 2 and config.decode.num_threads == 2
    zero = _build_parser().parse_args(["serve", "--model", str(model_dir), "--threads", "0"])
    with pytest.raises(ValueError, match="num_threads"):
        app_config_from_args(zero)
    # auto is every pool's default too: the cores, shared among the busy replicas.
    auto = _build_parser().parse_args(["serve", "--model", str(model_dir), "--threads", "auto"])
    assert app_config_from_args(auto).decode.num_threads == "auto"
    assert app_config_from_args(_build_parser().parse_args(["serve"])).prefill.num_threads == (
        "auto"
    )
    with pytest.raises(SystemExit):
        _build_parser().parse_args(["serve", "--threads", "many"])


def test_activations_apply_to_every_pool_and_default_to_exact(model_dir, tmp_path):
    args = _build_parser().parse_args(["serve", "--model", str(model_dir), "--activations", "int8"])
    config = app_config_from_args(args)
    assert {getattr(config, pool).activations for pool in config.pools()} == {"int8"}
    engine = config.engine_config(config.decode, str(model_dir), "m")
    assert engine.activations == "int8"
    default = app_config_from_args(_build_parser().parse_args(["serve"]))
    assert {getattr(default, pool).activations for pool in default.pools()} == {"exact"}
    engine = default.engine_config(default.decode, str(model_dir), "m")
    assert engine.activations == "exact"
    # Without the flag, a file's setting stands; with it, the flag wins.
    path = tmp_path / "app.yaml"
    path.write_text(f"model: {model_dir}\ndecode:\n  activations: int16\n")
    config = app_config_from_args(_build_parser().parse_args(["serve", "--config", str(path)]))
    assert (config.decode.activations, config.prefill.activations) == ("int16", "exact")
    flagged = ["serve", "--config", str(path), "--activations", "int8"]
    config = app_config_from_args(_build_parser().parse_args(flagged))
    assert (config.decode.activations, config.prefill.activations) == ("int8", "int8")


def test_unknown_activations_are_refused_naming_the_choices(model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _build_parser().parse_args(["serve", "--activations", "int4"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --activations: invalid choice: 'int4'" in error
    assert all(choice in error for choice in ("exact", "int16", "int8"))
    path = tmp_path / "app.yaml"
    path.write_text(f"model: {model_dir}\ndecode:\n  activations: int4\n")
    with pytest.raises(ValueError, match=r"decode\.activations: .*'exact', 'int16' or 'int8'"):
        app_config_from_args(_build_parser().parse_args(["serve", "--config", str(path)]))
