"""`baton bench`'s figures: one summary per load point, as a JSON line and a table row,
and the throughput-latency plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from serve_app.ops.bench.stream_client import RequestResult

PERCENTILES = (50, 90, 99)


def _percentiles(values: list[float], name: str) -> dict[str, float | None]:
    """`name_pNN_ms` for each percentile (None without values), in milliseconds."""
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        out[f"{name}_p{p}_ms"] = _percentile(values, p) * 1000 if values else None
    out[f"{name}_mean_ms"] = statistics.fmean(values) * 1000 if values else None
    return out


def _percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    results: list[RequestResult],
    seconds: float,
    load: dict[str, Any],
    ttft_slo_s: float | None,
    tpot_slo_s: float | None,
) -> dict[str, Any]:
    """The figures of one load point. Goodput counts the completed requests whose TTFT
    and time per output token met the given targets (all completed ones if none given)."""
    done = [r for r in results if r.ok]
    good = [
        r
        for r in done
        if (ttft_slo_s is None or (r.ttft is not None and r.ttft <= ttft_slo_s))
        and (tpot_slo_s is None or r.tpot is None or r.tpot <= tpot_slo_s)
    ]
    output_tokens = sum(r.output_tokens for r in done)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        **load,
        "requests_sent": len(results),
        "requests_completed": len(done),
        "requests_failed": len(results) - len(done),
        "duration_s": seconds,
        "request_throughput": len(done) / seconds,
        "output_token_throughput": output_tokens / seconds,
        "total_token_throughput": (output_tokens + sum(r.prompt_tokens for r in done)) / seconds,
        "goodput": len(good) / seconds,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        **_percentiles([r.ttft for r in done if r.ttft is not None], "ttft"),
        **_percentiles([r.tpot for r in done if r.tpot is not None], "tpot"),
        **_percentiles([gap for r in done for gap in r.itl], "itl"),
        **_percentiles([r.e2e for r in done], "e2e"),
        "errors": errors[:5],
    }


_COLUMNS = [
    ("load", None),
    ("done", "requests_completed"),
    ("failed", "requests_failed"),
    ("req/s", "request_throughput"),
    ("out tok/s", "output_token_throughput"),
    ("goodput", "goodput"),
    ("TTFT p50", "ttft_p50_ms"),
    ("TTFT p99", "ttft_p99_ms"),
    ("TPOT p50", "tpot_p50_ms"),
    ("ITL p99", "itl_p99_ms"),
    ("E2E p50", "e2e_p50_ms"),
]


def load_label(row: dict[str, Any]) -> str:
    if "concurrency" in row:
        return f"c={row['concurrency']}"
    return f"rate={row['request_rate']:g}/s"


def table(rows: list[dict[str, Any]]) -> str:
    """The summaries as an aligned text table (latencies in ms)."""
    cells = [[name for name, _ in _COLUMNS]]
    for row in rows:
        line = [load_label(row)]
        for _, key in _COLUMNS[1:]:
            value = row[key]
            line.append(
                "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)
            )
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Output-token throughput against TTFT and TPOT (p50), one point per load point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'baton-llm[bench]' (or matplotlib)"
        ) from None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [row["output_token_throughput"] for row in rows]
    for ax, key, name in (
        (axes[0], "ttft_p50_ms", "TTFT p50 (ms)"),
        (axes[1], "tpot_p50_ms", "TPOT p50 (ms)"),
    ):
        y = [row[key] if row[key] is not None else float("nan") for row in rows]
        ax.plot(x, y, marker="o")
        for xi, yi, row in zip(x, y, rows, strict=True):
            ax.annotate(load_label(row), (xi, yi), textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
