"""`baton bench` against a live Baton (the aggregated app of conftest's `service`): every
request it sends is accounted for, the token counts are the server's, and it plots."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

SERVICE_APPS = ("agg",)


def test_a_sweep_against_baton_accounts_for_every_request(service, tmp_path, capsys):
    from serve_app.ops.cli import main

    png = tmp_path / "sweep.png"
    args = ["bench", "--base-url", f"{service['http']}/agg/v1", "--no-progress"]
    args += ["--num-prompts", "8", "--input-len", "24", "--output-len", "8"]
    assert main([*args, "--concurrency", "1,4", "--ttft-slo-ms", "60000", "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["concurrency"] for r in rows] == [1, 4]
    for row in rows:
        assert row["model"] == "SmolLM2-135M-Instruct"
        assert row["requests_sent"] == row["requests_completed"] + row["requests_failed"] == 8
        assert row["requests_failed"] == 0, row["errors"]
        assert row["output_tokens"] == 8 * 8  # ignore_eos: exactly what was asked
        assert row["prompt_tokens"] >= 8 * 24  # the server's own count of each prompt
        assert row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0
        assert row["goodput"] == row["request_throughput"]  # a 60 s TTFT target: all good
    assert "c=4" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
