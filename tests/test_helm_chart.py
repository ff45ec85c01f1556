"""The Helm chart (helm/): renders with the real Helm library, lints clean, and its values
schema refuses bad values naming the value at fault.

Everything is offline: Helm is the Go library bundled by helm-python-sdk. That what it
renders is accepted by Kubernetes and KubeRay is checked in test_helm_chart_kubernetes.py,
that it deploys exactly the Serve config `baton serve` would in
test_helm_chart_serve_config.py, and that worker groups host their Serve pools in
test_helm_chart_worker_groups.py.
"""

from __future__ import annotations

import typing

import helm_python as helm
import pytest
from helm_chart_helpers import CHART, KUBE_VERSION, RELEASE, value_sets

from serve_app.config import Activations, DType, Mode, Transport


def test_schema_enums_are_the_config_literals(chart):
    props = chart.schema["properties"]
    assert tuple(props["transport"]["enum"]) == Transport.__args__
    assert tuple(props["mode"]["enum"]) == typing.get_args(Mode)
    pool = chart.schema["definitions"]["pool"]["properties"]["replica"]["properties"]
    assert tuple(pool["dtype"]["enum"]) == typing.get_args(DType)
    assert tuple(pool["activations"]["enum"]) == typing.get_args(Activations)


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
        (
            {"decode": {"replica": {"activations": "int4"}}},
            ["/decode/replica/activations", "exact"],
        ),
        ({"prefill": {"replica": {"q8Activations": True}}}, ["/prefill/replica", "q8Activations"]),
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
            ["aggregated.tensorParallelSize=9", "intermediateSize=1536", "valid degrees: 1, 3"],
        ),
        (
            # Gemma 3 270M: one KV head, so 2 and 4 replicate it; 3 splits no head count.
            {
                "model": {"numAttentionHeads": 4, "numKeyValueHeads": 1, "intermediateSize": 2048},
                "decode": {"tensorParallelSize": 3},
            },
            ["decode.tensorParallelSize=3", "valid degrees: 1, 2, 4"],
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
        ({"decode": {"rayResource": "GPU"}}, ["decode.rayResource (GPU) is Ray's own"]),
        ({"router": {"rayResources": {"CPU": 1}}}, ["router.rayResources.CPU is Ray's own"]),
        (
            {"decode": {"replica": {"maxNumBatchedTokens": 32}}},
            ["decode.replica.maxNumBatchedTokens (32) must be >= decode.replica.maxNumSeqs (64)"],
        ),
        ({"prefill": {"replicas": 9}}, ["prefill.maxPods (8) must be >= prefill.replicas (9)"]),
        (
            {"decode": {"autoscaling": {"enabled": True, "maxReplicas": 12}}},
            ["decode.maxPods (8) must be >= decode.autoscaling.maxReplicas (12)"],
        ),
        ({"decode": {"maxPods": 0}}, ["/decode/maxPods", "minimum"]),
        ({"prefill": {"replicas": 0}}, ["prefill.replicas must be >= 1", "autoscaling"]),
        ({"sharedMemory": {"sizeLimit": "lots"}}, ["/sharedMemory/sizeLimit", "pattern"]),
        ({"decode": {"terminationGracePeriodSeconds": 5}}, ["terminationGracePeriodSeconds"]),
        (
            {"decode": {"terminationGracePeriodSeconds": 100}},
            ["decode.terminationGracePeriodSeconds (100)", "gracefulShutdownTimeoutS (120)"],
        ),
        ({"volumes": [{"name": "dshm", "emptyDir": {}}]}, ["volumes", '"dshm"', "rename"]),
        (
            {"volumeMounts": [{"name": "shm", "mountPath": "/dev/shm/"}]},
            ["/dev/shm is mounted by the chart", "sharedMemory.enabled=false"],
        ),
        ({"volumeMounts": [{"name": "models"}]}, ["/volumeMounts/0", "mountPath"]),
        (
            {"router": {"replicas": 3}},
            ["router.replicas (3) x router.numCpus (1) needs 3 CPUs", "has 2 (head.resources)"],
        ),
        (
            {"head": {"rayStartParams": {"num-cpus": "0"}}},
            ["has 0 (head.rayStartParams.num-cpus)", "router.onHead=false"],
        ),
        (
            {"head": {"rayStartParams": {"resources": '"{\\"gpu_head\\": 1}"'}}},
            ["head.rayStartParams.resources", "router.onHead=false"],
        ),
        ({"router": {"replicas": 1001}}, ["/router/replicas", "maximum"]),
        ({"maxPendingPrefills": 0}, ["/maxPendingPrefills", "minimum"]),
        ({"localPrefillTokens": -1}, ["/localPrefillTokens", "minimum"]),
        ({"apiKey": {"secretName": "keys", "secretKey": ""}}, ["/apiKey/secretKey"]),
        ({"registryName": ""}, ["/registryName", "minLength"]),
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
