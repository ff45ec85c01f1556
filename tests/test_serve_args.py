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


def test_q8_activations_turn_on_for_every_pool_and_stay_off_by_default(model_dir, tmp_path):
    args = _build_parser().parse_args(["serve", "--model", str(model_dir), "--q8-activations"])
    config = app_config_from_args(args)
    assert all(getattr(config, pool).q8_activations for pool in config.pools())
    engine = config.engine_config(config.decode, str(model_dir), "m")
    assert engine.q8_activations
    default = app_config_from_args(_build_parser().parse_args(["serve"]))
    assert not any(getattr(default, pool).q8_activations for pool in default.pools())
    # Without the flag, a file's setting stands.
    path = tmp_path / "app.yaml"
    path.write_text(f"model: {model_dir}\ndecode:\n  q8_activations: true\n")
    config = app_config_from_args(_build_parser().parse_args(["serve", "--config", str(path)]))
    assert config.decode.q8_activations and not config.prefill.q8_activations
