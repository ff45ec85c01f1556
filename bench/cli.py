"""Wall time of a one-token `baton generate` and of `baton status` against a service.

Each command runs as a user runs it, in a fresh process: `generate` over gRPC, `status`
through the cluster.

Without --address it starts the service as the README's first command does (`baton
serve`, the bundled model), measures, and then stops what it started (`baton stop`); it
refuses to start when the application is already deployed, so it never stops a service it
did not start. With --address HOST:PORT (a running service's gRPC address) it deploys
nothing and leaves everything as it was; `baton status` then finds the cluster as it
always does (RAY_ADDRESS, else the one on this machine).

Each command runs once untimed first (`*.first_s`: the service's first request, and the
page cache's first read of the code), then --runs times: `cli.<command>.median_s` and
`.p90_s` (nearest rank). `cli.help` is `baton --help`, the floor a Python process and the
parser set.

    .venv/bin/python bench/cli.py [--runs 10] [--address HOST:PORT] [--app NAME]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_count, emit, git_commit, log, median

_ROOT = Path(__file__).resolve().parent.parent


def _baton() -> list[str]:
    """The `baton` script beside this Python (the venv's), else the module."""
    script = Path(sys.executable).with_name("baton")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "serve_app.ops.cli"]


def _run(args: list[str], *, ok: tuple[int, ...] = (0,)) -> tuple[float, int]:
    """Runs `baton ARGS` from the repository root; its wall time and exit status. A
    status outside `ok` stops the benchmark with the command's stderr."""
    start = time.perf_counter()
    done = subprocess.run(
        [*_baton(), *args], cwd=_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    elapsed = time.perf_counter() - start
    if done.returncode not in ok:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"`baton {' '.join(args)}` exited {done.returncode}: {tail}")
    return elapsed, done.returncode


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def _measure(name: str, args: list[str], runs: int, **ctx) -> None:
    first, _ = _run(args)
    emit(f"cli.{name}.first_s", first, "s", **ctx)
    times = [_run(args)[0] for _ in range(runs)]
    emit(f"cli.{name}.median_s", median(times), "s", runs=runs, **ctx)
    emit(f"cli.{name}.p90_s", _p90(times), "s", runs=runs, **ctx)
    log(f"{name}: median {median(times):.2f}s, p90 {_p90(times):.2f}s over {runs} runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="timed runs of each command")
    parser.add_argument(
        "--address",
        default=None,
        help="a running service's gRPC address (HOST:PORT): measure it, deploy nothing",
    )
    parser.add_argument("--app", default=None, help="the Serve application (default: baton)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    app = ["--app", args.app] if args.app else []
    started = args.address is None
    if started:
        # 0 (running) or 1 (deploying, failed): deployed already, and not ours to stop.
        _, code = _run(["status", *app], ok=(0, 1, 2))
        if code != 2:
            raise SystemExit(
                "bench/cli.py: the application is already deployed; pass --address HOST:PORT "
                "to measure it (this script stops only a service it started)"
            )
        log("starting the service: baton serve")
        serve_s, _ = _run(["serve", *app])
        log(f"serving after {serve_s:.1f}s")
    ctx = {
        "commit": git_commit(),
        "started_here": started,
        "cpus": cpu_count(),
    }
    try:
        _measure("help", ["--help"], args.runs, **ctx)
        address = ["--address", args.address] if args.address else []
        generate = ["generate", "--max-tokens", "1", *address, *app, "Hello"]
        _measure("generate_1_token", generate, args.runs, **ctx)
        _measure("status", ["status", *app], args.runs, **ctx)
    finally:
        if started:
            log("stopping what this script started: baton stop")
            _run(["stop", *app], ok=(0, 1, 2))


if __name__ == "__main__":
    main()
