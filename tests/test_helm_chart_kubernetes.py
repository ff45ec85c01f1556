"""The Helm chart renders objects Kubernetes and KubeRay accept.

Offline: built-in kinds are checked against kubernetes-validate's schemas, the RayService
against KubeRay's CRD (kept beside the checkout in ../shared/crds).
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_chart_helpers import CRD, KUBE_VERSION, _rayservice, _render, value_sets


def _is_builtin(api_version: str) -> bool:
    group = api_version.rpartition("/")[0]
    return group == "" or group.endswith(".k8s.io") or "." not in group


@value_sets
def test_objects_validate_as_kubernetes_objects(chart, values):
    docs = _render(chart, values)
    builtin = [d for d in docs if _is_builtin(d["apiVersion"])]
    assert [d["kind"] for d in builtin] == ["ConfigMap", "Service"]  # the dashboard, the ports
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


def test_the_network_policy_opens_the_apis_and_ray_between_the_releases_pods(chart):
    prometheus = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    clients = {"ipBlock": {"cidr": "10.0.0.0/8"}}
    values = {"networkPolicy": {"enabled": True, "apiFrom": [clients], "metricsFrom": [prometheus]}}
    (policy,) = [d for d in _render(chart, values) if d["kind"] == "NetworkPolicy"]
    kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
    spec = policy["spec"]
    pods = spec["podSelector"]["matchLabels"]
    assert pods["app.kubernetes.io/instance"] == "demo"
    api, ray_pods, metrics = spec["ingress"]
    assert [p["port"] for p in api["ports"]] == [8000, 9000] and api["from"] == [clients]
    assert ray_pods == {"from": [{"podSelector": {"matchLabels": pods}}]}  # every port
    assert [p["port"] for p in metrics["ports"]] == [8080] and metrics["from"] == [prometheus]
    # Off by default; on with no peers named, the APIs are open to all and metrics closed.
    assert not [d for d in _render(chart, {}) if d["kind"] == "NetworkPolicy"]
    (open_policy,) = [
        d
        for d in _render(chart, {"networkPolicy": {"enabled": True}})
        if d["kind"] == "NetworkPolicy"
    ]
    api, ray_pods = open_policy["spec"]["ingress"]
    assert "from" not in api
