"""What the Helm chart tests share: paths, the value sets an operator would install, and
rendering the chart (with the real Helm library) into objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from serve_app.config import AppConfig, AutoscalingConfig
from serve_app.serve_config import DEPLOYMENT_NAMES, ROUTER_NAME

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
    "decode": {
        "maxPods": 12,
        "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 10},
    },
    "rayAutoscaler": {"idleTimeoutSeconds": 120, "upscalingMode": "Conservative"},
    "podMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
}
# Aggregated, with no bound on the requests a router queues for the pool (null).
AGGREGATED = {
    "mode": "aggregated",
    "aggregated": {"replicas": 2, "replica": {"maxQueuedRequests": None}},
}
# One machine's pools: decode takes short prompts and prefill-pool backlogs itself; and
# a prefix registry named to share with another application on the cluster.
SELECTIVE = {"localPrefillTokens": 16, "maxPendingPrefills": 4, "registryName": "shared-prefixes"}
# A model from a PersistentVolumeClaim, a bounded /dev/shm, a longer stop for decode,
# extra environment.
MODEL_VOLUME = {
    "model": {"path": "/models/SmolLM2-135M-Instruct"},
    "volumes": [
        {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    ],
    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    "sharedMemory": {"enabled": True, "sizeLimit": "2Gi"},
    "decode": {"terminationGracePeriodSeconds": 600},
    "apiKey": {"secretName": "baton-api-keys", "secretKey": "keys"},
    "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
}
VALUE_SETS = {
    "default": {},
    "cpu-only": CPU_ONLY,
    "multi-gpu-tp": MULTI_GPU_TP,
    "autoscaling": AUTOSCALING,
    "aggregated": AGGREGATED,
    "selective-disaggregation": SELECTIVE,
    "model-volume": MODEL_VOLUME,
}
value_sets = pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())


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


def app_config_of(app: dict[str, Any]) -> AppConfig:
    """The AppConfig a Serve config application describes: its `args`, with the replica
    counts and autoscaling its `deployments:` overrides set."""
    config = AppConfig.model_validate(app["args"])
    roles = {name: role for role, name in DEPLOYMENT_NAMES.items()}
    update: dict[str, Any] = {}
    for override in app["deployments"]:
        if override["name"] == ROUTER_NAME:
            router = config.router.model_dump() | {"num_replicas": override["num_replicas"]}
            update["router"] = router
            continue
        role = roles[override["name"]]
        scale = override.get("autoscaling_config")
        if scale is None:
            pool = {"num_replicas": override["num_replicas"]}
        else:
            assert override["num_replicas"] is None, override
            bounds = ("min_replicas", "max_replicas", "target_ongoing_requests")
            pool = {
                "num_replicas": scale["initial_replicas"],
                "autoscaling": AutoscalingConfig(**{k: scale[k] for k in bounds}),
            }
        update[role] = getattr(config, role).model_dump() | pool
    return AppConfig.model_validate(config.model_dump() | update)
