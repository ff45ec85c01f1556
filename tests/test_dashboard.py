"""The Grafana dashboard the chart ships (helm/dashboards/baton.json): every query names a
series serve_app/metrics.py exports, and the chart puts it in a ConfigMap for Grafana's
sidecar."""

from __future__ import annotations

import json
import re

from helm_chart_helpers import CHART, _render

from serve_app.metrics import SERIES

DASHBOARD = CHART / "dashboards" / "baton.json"
# What Prometheus scrapes of a series Ray exports: its name with Ray's prefix, and a
# histogram's _bucket / _count / _sum.
_HISTOGRAM_PARTS = ("_bucket", "_count", "_sum")


def _exported() -> set[str]:
    names = set()
    for name, kind in SERIES.items():
        parts = _HISTOGRAM_PARTS if kind == "histogram" else ("",)
        names.update(f"ray_{name}{part}" for part in parts)
    return names


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def test_every_query_names_an_exported_series():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = _exported()
    queries = _queries(dashboard)
    assert len(queries) >= 12
    named = set()
    for expr in queries:
        series = set(re.findall(r"\bray_[A-Za-z0-9_:]+", expr))
        assert series, f"query names no series: {expr}"
        assert series <= exported, f"{sorted(series - exported)} not exported: {expr}"
        named |= series
    # What an operator of a P/D deployment looks at has a panel.
    for needed in (
        "ray_vllm_time_to_first_token_seconds_bucket",
        "ray_vllm_inter_token_latency_seconds_bucket",
        "ray_vllm_num_requests_running",
        "ray_vllm_num_requests_waiting",
        "ray_vllm_kv_cache_usage_perc",
        "ray_vllm_prefix_cache_hits_total",
        "ray_baton_kv_handoff_bytes_total",
        "ray_baton_kv_handoff_seconds_bucket",
    ):
        assert needed in named, needed


def test_panels_break_load_down_by_pool_and_filter_by_model():
    dashboard = json.loads(DASHBOARD.read_text())
    by_pool = [p["title"] for p in dashboard["panels"] if "by (pool)" in json.dumps(p["targets"])]
    assert len(by_pool) >= 4, by_pool
    for expr in _queries(dashboard)[:-1]:  # the model variable's own query aside
        assert 'model_name=~"$model"' in expr, expr


def test_the_chart_ships_it_for_grafanas_sidecar(chart):
    maps = [d for d in _render(chart, {}) if d["kind"] == "ConfigMap"]
    assert [m["metadata"]["labels"]["grafana_dashboard"] for m in maps] == ["1"]
    assert json.loads(maps[0]["data"]["baton.json"]) == json.loads(DASHBOARD.read_text())
    off = _render(chart, {"grafanaDashboard": {"enabled": False, "labels": {}}})
    assert not [d for d in off if d["kind"] == "ConfigMap"]
