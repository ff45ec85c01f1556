"""The Helm chart deploys exactly the Serve config `baton serve` would, checked offline
against Ray Serve's own schema (unknown keys included) and the chart's values."""

from __future__ import annotations

import copy
import typing
from typing import Any

from helm_chart_helpers import (
    _merged,
    _rayservice,
    _render,
    _serve_config,
    app_config_of,
    value_sets,
)
from pydantic import BaseModel
from ray.serve.schema import ServeDeploySchema

from serve_app.config import AppConfig
from serve_app.serve_config import serve_config


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _unknown_keys(model: type[BaseModel], data: Any, path: str = "") -> list[str]:
    """Keys of `data` the Serve schema does not define.

    Serve's schemas ignore unknown keys (forward compatibility), so a misspelt option
    would be dropped silently; this walks the pydantic fields to catch them.
    """
    if not isinstance(data, dict):
        return []
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    unknown = []
    for key, value in data.items():
        if key not in fields:
            unknown.append(path + key)
            continue
        candidates = _models_in(fields[key].annotation)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            where = f"{path}{key}[{i}]." if isinstance(value, list) else f"{path}{key}."
            found = [_unknown_keys(m, item, where) for m in candidates]
            if found:
                unknown += min(found, key=len)
    return unknown


def test_unknown_serve_keys_are_caught():
    config = serve_config(AppConfig())
    assert _unknown_keys(ServeDeploySchema, config) == []
    config["http_options"]["hots"] = "0.0.0.0"
    config["applications"][0]["import_pth"] = "x:y"
    assert _unknown_keys(ServeDeploySchema, config) == [
        "http_options.hots",
        "applications[0].import_pth",
    ]


def _normalised(config: dict[str, Any]) -> dict[str, Any]:
    """The config with each app's args put through AppConfig (defaults dropped)."""
    config = copy.deepcopy(config)
    for app in config["applications"]:
        app["args"] = AppConfig.model_validate(app["args"]).model_dump(
            mode="json", exclude_defaults=True
        )
    return config


@value_sets
def test_serve_config_is_what_baton_serve_deploys(chart, values):
    rendered = _serve_config(_rayservice(_render(chart, values)))
    ServeDeploySchema.model_validate(rendered)
    assert _unknown_keys(ServeDeploySchema, rendered) == []
    (app,) = rendered["applications"]
    assert _normalised(rendered) == _normalised(serve_config(app_config_of(app)))


def _expected_app_config(v: dict[str, Any]) -> AppConfig:
    """The AppConfig the (merged) values describe, written independently of the template."""

    def pool(p: dict[str, Any]) -> dict[str, Any]:
        r = p["replica"]
        out = {
            "num_replicas": p["replicas"],
            "tensor_parallel_size": p["tensorParallelSize"],
            "num_cpus": r["numCpus"],
            "num_gpus": r["numGpus"],
            "resources": {p["rayResource"]: 1},
            "kv_cache_bytes": r["kvCacheBytes"],
            "max_num_seqs": r["maxNumSeqs"],
            "max_num_batched_tokens": r["maxNumBatchedTokens"],
            "num_threads": r["numThreads"],
            "dtype": r["dtype"],
            "max_ongoing_requests": r["maxOngoingRequests"],
            # A null value is no limit; Helm drops the key.
            "max_queued_requests": r.get("maxQueuedRequests"),
            "graceful_shutdown_timeout_s": r["gracefulShutdownTimeoutS"],
            "speculative_tokens": r["speculativeTokens"],
            "activations": r["activations"],
        }
        a = p["autoscaling"]
        if a["enabled"]:
            out["autoscaling"] = {
                "min_replicas": a["minReplicas"],
                "max_replicas": a["maxReplicas"],
                "target_ongoing_requests": a["targetOngoingRequests"],
            }
        return out

    roles = ["aggregated"] if v["mode"] == "aggregated" else ["prefill", "decode"]
    return AppConfig.model_validate(
        {
            "model": v["model"]["path"],
            "served_model_name": v["model"].get("servedModelName"),
            "max_model_len": v["model"].get("maxModelLen"),
            "mode": v["mode"],
            "transport": v["transport"],
            "block_size": v["blockSize"],
            "enable_prefix_caching": v["enablePrefixCaching"],
            "handoff_timeout_s": v["handoffTimeoutS"],
            "local_prefill_tokens": v["localPrefillTokens"],
            "max_pending_prefills": v.get("maxPendingPrefills"),
            "stream_interval": v["streamInterval"],
            "output_channel": v["outputChannel"],
            # null (Helm drops the key): the application's own registry.
            "registry_name": v.get("registryName"),
            # The Secret's mount (test_helm_chart_pods.py); the keys stay out of the config.
            "api_key_file": "/etc/baton/api-keys/keys" if v["apiKey"]["secretName"] else None,
            "router": {
                "num_replicas": v["router"]["replicas"],
                "num_cpus": v["router"]["numCpus"],
                "resources": v["router"]["rayResources"]
                | ({"baton_router": 1} if v["router"]["onHead"] else {}),
                "max_ongoing_requests": v["router"]["maxOngoingRequests"],
            },
            **{role: pool(v[role]) for role in roles},
        }
    )


@value_sets
def test_the_application_carries_every_value(chart, values):
    (app,) = _serve_config(_rayservice(_render(chart, values)))["applications"]
    expected = _expected_app_config(_merged(chart, values))
    assert app_config_of(app) == expected
    # Counts and autoscaling only in the overrides: Serve versions replicas by the args.
    assert AppConfig.model_validate(app["args"]) == expected.without_scale()


def test_by_default_the_application_gets_a_prefix_registry_of_its_own(chart):
    # No name in its args: the replicas derive the application's own (AppConfig
    # .prefix_registry), so no other application on the cluster shares it.
    (app,) = _serve_config(_rayservice(_render(chart, {})))["applications"]
    assert "registry_name" not in app["args"]
    assert app_config_of(app).registry_name is None
    (app,) = _serve_config(_rayservice(_render(chart, {"registryName": "shared"})))["applications"]
    assert app["args"]["registry_name"] == "shared"
