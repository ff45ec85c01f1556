"""`baton serve`'s configuration: an AppConfig file with the command line's flags over it,
refused in one line (the file, the YAML position or the field at fault) before any Ray
cluster is joined or started."""

from __future__ import annotations

import argparse

import yaml
from pydantic import ValidationError

from serve_app.config import AppConfig

POOLS = ("prefill", "decode", "aggregated")


def app_config_from_args(args: argparse.Namespace) -> AppConfig:
    """The AppConfig of `--config` FILE (YAML or JSON) with the flags over it; ValueError
    in one line naming what is wrong."""
    fields: dict = {}
    if args.config:
        fields = _read_config_file(args.config)
    if args.model:
        fields["model"] = args.model
    if args.mode:
        fields["mode"] = args.mode
    for pool in POOLS:
        flags = {
            "num_replicas": getattr(args, f"{pool}_replicas"),
            "tensor_parallel_size": getattr(args, f"{pool}_tp"),
            "dtype": args.dtype,
            "num_threads": args.threads,
            "activations": args.activations,
        }
        overrides = {k: v for k, v in flags.items() if v is not None}
        if overrides:  # a pool key left empty in the file (`decode:`) loads as None
            current = fields.get(pool) or {}
            if not isinstance(current, dict):
                raise ValueError(
                    f"--config {args.config}: {pool} must be a mapping of PoolConfig fields "
                    f"(e.g. `{pool}: {{num_replicas: 2}}`), got {current!r}"
                )
            fields[pool] = {**current, **overrides}
    try:
        config = AppConfig.model_validate(fields)
    except ValidationError as e:
        raise ValueError(f"invalid configuration: {_one_line(e)}") from None
    unused = [p for p in POOLS if p not in config.pools()]
    for pool in unused:
        for flag in (f"{pool}_replicas", f"{pool}_tp"):
            if getattr(args, flag) is not None:
                raise ValueError(
                    f"--{flag.replace('_', '-')} does not apply in {config.mode} mode "
                    f"(its pools: {', '.join(config.pools())})"
                )
    return config


def _read_config_file(path: str) -> dict:
    try:
        with open(path) as f:
            fields = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ValueError(f"--config {path}: not valid YAML{at}: {problem}") from None
    if fields is None:
        return {}
    if not isinstance(fields, dict):
        raise ValueError(f"--config {path}: must be a mapping of AppConfig fields")
    return fields


def _one_line(error: ValidationError) -> str:
    """Each of pydantic's errors as `field.path: message`, joined on one line."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in error.errors()
    )
