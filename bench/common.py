"""Shared helpers for benchmarks: one JSON object per line on stdout."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def emit(metric: str, value: float, unit: str, **context) -> None:
    line = {"metric": metric, "value": round(float(value), 6), "unit": unit, **context}
    print(json.dumps(line), flush=True)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))
