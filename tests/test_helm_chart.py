"""The Helm chart (helm/): renders with the real Helm library, lints clean, produces objects
Kubernetes and KubeRay accept, and deploys exactly the Serve config `baton serve` would.

Everything is offline: Helm is the Go library bundled by helm-python-sdk, built-in kinds are
checked against kubernetes-validate's schemas, the RayService against KubeRay's CRD (kept
beside the checkout in ../shared/crds), serveConfigV2 against Ray Serve's own schema.
"""

from __future__ import annotations

import copy
import json
import typing
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel
from ray.serve.schema import ServeDeploySchema

from serve_app.config import TRANSPORTS, AppConfig, DType, Mode
from serve_app.serve_config import serve_config

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm"
CRD = REPO.parent / "shared" / "crds" / "ray.io_rayservices.yaml"
# A recent release kubernetes-validate ships schemas for; lint checks against it too.
KUBE_VERSION = "1.35.0"
RELEASE = "demo"

# Value sets an operator would plausibly install, beside the defaults.
CPU_ONLY = {
    "prefill": {
        "replicas": 2,
        "replica": {
            "numCpus": 1,
            "numThreads": 2,
            "kvCacheBytes": 256 * 2**20,
            "dtype": "bfloat16",
        },
        "resources": {
            "requests": {"cpu": "3", "memory": "6Gi"},
            "limits": {"cpu": "3", "memory": "6Gi"},
        },
        "nodeSelector": {"node.kubernetes.io/instance-type": "c7i.xlarge"},
    },
    "decode": {
        "replicas": 3,
        "replica": {"maxNumSeqs": 128, "maxOngoingRequests": 256},
        "resources": {"requests": {"cpu": "1500m", "memory": "3Gi"}, "limits": {"memory": "3Gi"}},
    },
    "router": {"replicas": 2},
    "blockSize": 32,
    "enablePrefixCaching": False,
    "streamInterval": 4,
}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
MULTI_GPU_TP = {
    "image": {"repository": "registry.example.com/baton", "tag": "0.1.0-cuda"},
    "prefill": {
        "tensorParallelSize": 3,
        "replica": {"numGpus": 1, "kvCacheBytes": 8 * 2**30},
        "resources": {
            "requests": {"cpu": "8", "memory": "48Gi"},
            "limits": {"cpu": "8", "memory": "48Gi", "nvidia.com/gpu": 3},
        },
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [GPU_TOLERATION],
    },
    "decode": {
        "replicas": 2,
        "replica": {"numGpus": 1, "maxNumSeqs": 256},
        "resources": {
            "requests": {"cpu": "4", "memory": "24Gi"},
            "limits": {"cpu": "4", "memory": "24Gi", "nvidia.com/gpu": 1},
        },
        "tolerations": [GPU_TOLERATION],
    },
}
AUTOSCALING = {
    "model": {"servedModelName": "smollm2", "maxModelLen": 2048},
    "prefill": {
        "replicas": 2,
        "autoscaling": {
            "enabled": True,
            "minReplicas": 1,
            "maxReplicas": 6,
            "targetOngoingRequests": 8,
        },
    },
    "decode": {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 10}},
    "rayAutoscaler": {"idleTimeoutSeconds": 120, "upscalingMode": "Conservative"},
    "podMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
}
AGGREGATED = {"mode": "aggregated", "aggregated": {"replicas": 2}}
VALUE_SETS = {
    "default": {},
    "cpu-only": CPU_ONLY,
    "multi-gpu-tp": MULTI_GPU_TP,
    "autoscaling": AUTOSCALING,
    "aggregated": AGGREGATED,
}
value_sets = pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _render(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = chart.render(values=values, name=RELEASE, namespace="baton")
    return [
        doc
        for name, text in manifests.items()
        if not name.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def _rayservice(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == "RayService"]
    assert found["apiVersion"] == "ray.io/v1"
    return found


def _groups(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def _merged(chart: helm.Chart, values: dict[str, Any]) -> dict[str, Any]:
    return chart.merge_values(values)


# --- the values schema -----------------------------------------------------------------


def test_schema_enums_are_the_config_literals(chart):
    props = chart.schema["properties"]
    assert tuple(props["transport"]["enum"]) == TRANSPORTS
    assert tuple(props["mode"]["enum"]) == typing.get_args(Mode)
    pool = chart.schema["definitions"]["pool"]["properties"]["replica"]["properties"]
    assert tuple(pool["dtype"]["enum"]) == typing.get_args(DType)


@value_sets
def test_lint_strict_is_clean(values):
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


# Bad values fail the render (as they would `helm install`), naming the value at fault.
@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"prefill": {"replicas": -1}}, ["/prefill/replicas", "minimum"]),
        ({"decode": {"replicas": -3}}, ["/decode/replicas", "minimum"]),
        ({"transport": "carrier-pigeon"}, ["/transport", "object_store"]),
        ({"mode": "both"}, ["/mode", "disaggregated"]),
        ({"decode": {"replica": {"dtype": "fp8"}}}, ["/decode/replica/dtype", "bfloat16"]),
        ({"prefill": {"tensorParallelSize": 0}}, ["/prefill/tensorParallelSize"]),
        ({"prefill": {"replicaz": 2}}, ["/prefill", "replicaz"]),
        (
            {"prefill": {"tensorParallelSize": 2}},
            ["prefill.tensorParallelSize=2", "numAttentionHeads=9", "valid degrees: 1, 3"],
        ),
        (
            {"decode": {"tensorParallelSize": 4}},
            ["decode.tensorParallelSize=4", "numKeyValueHeads=3", "valid degrees: 1, 3"],
        ),
        (
            {"mode": "aggregated", "aggregated": {"tensorParallelSize": 9}},
            ["aggregated.tensorParallelSize=9", "valid degrees: 1, 3"],
        ),
        (
            {"prefill": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
            ["prefill.autoscaling.minReplicas (5)", "maxReplicas (2)"],
        ),
        (
            {"decode": {"replicas": 9, "autoscaling": {"enabled": True, "maxReplicas": 4}}},
            ["decode.replicas (9)", "1..4"],
        ),
        ({"decode": {"rayResource": "baton_prefill"}}, ["decode.rayResource", "prefill"]),
        ({"prefill": {"replicas": 0}}, ["prefill.replicas must be >= 1", "autoscaling"]),
        (
            {"prefill": {"tensorParallelSize": 3}},
            ["prefill pods have 2 CPUs", "needs 4", "prefill.tensorParallelSize=3"],
        ),
        (
            {
                "prefill": {
                    "tensorParallelSize": 3,
                    "replica": {"numGpus": 1},
                    "resources": {"limits": {"cpu": "8", "nvidia.com/gpu": 2}},
                }
            },
            ["prefill.resources.limits.nvidia.com/gpu >= 3", "got 2"],
        ),
    ],
)
def test_bad_values_fail_with_a_clear_message(chart, values, expected):
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as caught:
        chart.render(values=values, name=RELEASE)
    for part in expected:
        assert part in str(caught.value)


# --- Kubernetes and KubeRay accept what is rendered ---------------------------------------


def _is_builtin(api_version: str) -> bool:
    group = api_version.rpartition("/")[0]
    return group == "" or group.endswith(".k8s.io") or "." not in group


@value_sets
def test_objects_validate_as_kubernetes_objects(chart, values):
    docs = _render(chart, values)
    builtin = [d for d in docs if _is_builtin(d["apiVersion"])]
    assert [d["kind"] for d in builtin] == ["Service"]
    # The RayService embeds pod templates, which the CRD's structural schema only loosely
    # checks; hold them to Kubernetes' own schema too.
    cluster = _rayservice(docs)["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]]
    templates += [g["template"] for g in cluster["workerGroupSpecs"]]
    builtin += [
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": t}
        for t in templates
    ]
    for obj in builtin:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def _close_objects(schema: Any) -> None:
    """Make a CRD schema reject unknown fields, as the API server prunes/rejects them.

    An object schema listing properties, with no additionalProperties of its own, accepts
    only those properties; x-kubernetes-preserve-unknown-fields keeps a node open (as it
    does in the API server). int-or-string fields are anyOf [integer, string], which
    jsonschema handles as is.
    """
    if isinstance(schema, list):
        for item in schema:
            _close_objects(item)
        return
    if not isinstance(schema, dict):
        return
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        schema["additionalProperties"] = False
    for sub in schema.get("properties", {}).values():
        _close_objects(sub)
    for key in ("items", "additionalProperties", "not"):
        _close_objects(schema.get(key))
    for key in ("anyOf", "allOf", "oneOf"):
        _close_objects(schema.get(key, []))


@pytest.fixture(scope="module")
def crd_validator():
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    _close_objects(schema)
    return jsonschema.Draft7Validator(schema)


def test_closed_crd_schema_rejects_unknown_fields(chart, crd_validator):
    rayservice = _rayservice(_render(chart, {}))
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 2
    rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["nodeSelektor"] = {}
    errors = list(crd_validator.iter_errors(rayservice))
    assert len(errors) == 2, [e.message for e in errors]


@value_sets
def test_rayservice_validates_against_the_kuberay_crd(chart, crd_validator, values):
    rayservice = _rayservice(_render(chart, values))
    errors = sorted(crd_validator.iter_errors(rayservice), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


# --- the Serve config is baton's -------------------------------------------------------


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
    app_config = AppConfig.model_validate(app["args"])
    assert _normalised(rendered) == _normalised(serve_config(app_config))


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
            "stream_interval": v["streamInterval"],
            "registry_name": v["registryName"],
            "router": {
                "num_replicas": v["router"]["replicas"],
                "num_cpus": v["router"]["numCpus"],
                "resources": v["router"]["rayResources"],
                "max_ongoing_requests": v["router"]["maxOngoingRequests"],
            },
            **{role: pool(v[role]) for role in roles},
        }
    )


@value_sets
def test_app_args_carry_every_value(chart, values):
    rendered = _serve_config(_rayservice(_render(chart, values)))
    args = AppConfig.model_validate(rendered["applications"][0]["args"])
    assert args == _expected_app_config(_merged(chart, values))


# --- worker groups and Serve pools agree ---------------------------------------------------


def _ray_start_resources(group: dict[str, Any]) -> dict[str, float]:
    # KubeRay's form: a JSON object in escaped double quotes, '"{\"name\": 1}"'.
    raw = group["rayStartParams"]["resources"]
    assert raw.startswith('"') and raw.endswith('"'), raw
    return json.loads(raw[1:-1].replace('\\"', '"'))


@value_sets
def test_worker_groups_host_their_pools(chart, values):
    merged = _merged(chart, values)
    rayservice = _rayservice(_render(chart, values))
    groups = _groups(rayservice)
    args = AppConfig.model_validate(_serve_config(rayservice)["applications"][0]["args"])
    pools = args.pools()
    assert set(groups) == set(pools)
    any_autoscaling = False
    for role, pool in pools.items():
        group, v = groups[role], merged[role]
        # The replica's custom resource is offered by its own group's pods and no other's.
        (name,) = pool.resources
        assert _ray_start_resources(group) == {name: 1} and pool.resources[name] == 1
        others = [_ray_start_resources(g) for r, g in groups.items() if r != role]
        assert all(name not in o for o in others)
        # One replica per pod: the worker group follows the Serve pool's counts.
        assert group["replicas"] == pool.num_replicas
        if pool.autoscaling is None:
            assert group["minReplicas"] == group["maxReplicas"] == pool.num_replicas
        else:
            any_autoscaling = True
            assert group["minReplicas"] == pool.autoscaling.min_replicas
            assert group["maxReplicas"] == pool.autoscaling.max_replicas
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"] == v["resources"]
        assert pod.get("nodeSelector", {}) == v["nodeSelector"]
        assert pod.get("tolerations", []) == v["tolerations"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["serve"] == 8000 and ports["grpc"] == 9000 and ports["metrics"] == 8080
    cluster = rayservice["spec"]["rayClusterConfig"]
    # The head offers no pool resource, so no engine replica ever lands there.
    assert "resources" not in cluster["headGroupSpec"]["rayStartParams"]
    assert cluster["enableInTreeAutoscaling"] is any_autoscaling
    assert ("autoscalerOptions" in cluster) is any_autoscaling


def test_multi_gpu_group_requests_its_gpus(chart):
    groups = _groups(_rayservice(_render(chart, MULTI_GPU_TP)))
    prefill = groups["prefill"]["template"]["spec"]["containers"][0]
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 3
    assert prefill["image"] == "registry.example.com/baton:0.1.0-cuda"
    args = _serve_config(_rayservice(_render(chart, MULTI_GPU_TP)))["applications"][0]["args"]
    assert args["prefill"]["tensor_parallel_size"] == 3 and args["prefill"]["num_gpus"] == 1


def test_one_value_scales_one_pool(chart):
    """`helm upgrade --set prefill.replicas=4` moves prefill's pods and replicas, nothing else."""
    before = _rayservice(_render(chart, {}))
    after = _rayservice(_render(chart, helm.parse_set_string("prefill.replicas=4")))
    config_before, config_after = _serve_config(before), _serve_config(after)
    assert config_after["applications"][0]["args"]["prefill"]["num_replicas"] == 4
    config_after["applications"][0]["args"]["prefill"]["num_replicas"] = 1
    assert config_after == config_before
    groups = _groups(after)
    assert groups["prefill"]["replicas"] == groups["prefill"]["minReplicas"] == 4
    assert groups["prefill"]["maxReplicas"] == 4
    for key in ("replicas", "minReplicas", "maxReplicas"):
        groups["prefill"][key] = 1
    del before["spec"]["serveConfigV2"], after["spec"]["serveConfigV2"]
    assert after == before


def test_service_exposes_http_and_grpc_of_serving_pods(chart):
    docs = _render(chart, AUTOSCALING)
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert service["metadata"]["name"] == f"{RELEASE}-baton"
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["metadata"]["annotations"] == {"example.com/lb": "internal"}
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {"http": (8000, "serve"), "grpc": (9000, "grpc")}
    # KubeRay labels pods whose Serve proxy is up ray.io/serve=true; the rest of the
    # selector is this release's pod labels, so every Ray pod of it can be selected.
    selector = dict(service["spec"]["selector"])
    assert selector.pop("ray.io/serve") == "true"
    cluster = _rayservice(docs)["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]]
    templates += [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        assert selector.items() <= template["metadata"]["labels"].items()
        (container,) = template["spec"]["containers"]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert named["serve"] == 8000 and named["grpc"] == 9000


def test_pod_monitor_is_optional_and_scrapes_every_ray_pod(chart):
    assert not [d for d in _render(chart, {}) if d["kind"] == "PodMonitor"]
    docs = _render(chart, AUTOSCALING)
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    cluster = _rayservice(docs)["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]]
    templates += [g["template"] for g in cluster["workerGroupSpecs"]]
    selector = monitor["spec"]["selector"]["matchLabels"]
    for template in templates:
        assert selector.items() <= template["metadata"]["labels"].items()
        (container,) = template["spec"]["containers"]
        assert endpoint["port"] in {p["name"] for p in container["ports"]}
