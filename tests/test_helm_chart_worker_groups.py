"""The Helm chart's worker groups host their Serve pools (resources, replica counts,
autoscaling, scheduling), and its Service and PodMonitor select the Ray pods."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
from helm_chart_helpers import (
    AUTOSCALING,
    MULTI_GPU_TP,
    RELEASE,
    _groups,
    _merged,
    _rayservice,
    _render,
    _serve_config,
    app_config_of,
    value_sets,
)


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
    pools = app_config_of(_serve_config(rayservice)["applications"][0]).pools()
    assert set(groups) == set(pools)
    for role, pool in pools.items():
        group, v = groups[role], merged[role]
        # The replica's custom resource is offered by its own group's pods and no other's.
        (name,) = pool.resources
        assert _ray_start_resources(group) == {name: 1} and pool.resources[name] == 1
        others = [_ray_start_resources(g) for r, g in groups.items() if r != role]
        assert all(name not in o for o in others)
        # One replica per pod: the group starts at the pool's size, and its bounds never
        # follow it (KubeRay would not apply them to a running cluster); the autoscaler
        # meets Serve's demand within them, removing only idle pods.
        assert group["replicas"] == pool.num_replicas
        assert (group["minReplicas"], group["maxReplicas"]) == (0, v["maxPods"])
        most = pool.autoscaling.max_replicas if pool.autoscaling else pool.num_replicas
        assert most <= v["maxPods"]
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"] == v["resources"]
        assert pod.get("nodeSelector", {}) == v["nodeSelector"]
        assert pod.get("tolerations", []) == v["tolerations"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["serve"] == 8000 and ports["grpc"] == 9000 and ports["metrics"] == 8080
    cluster = rayservice["spec"]["rayClusterConfig"]
    # The head offers no pool resource, so no engine replica ever lands there; it offers
    # the routers' own, which no worker group does: routers run on the head alone.
    head = _ray_start_resources(cluster["headGroupSpec"])
    assert head == {"baton_router": 1000}
    router = app_config_of(_serve_config(rayservice)["applications"][0]).router
    assert router.resources == {**merged["router"]["rayResources"], "baton_router": 1}
    assert all("baton_router" not in _ray_start_resources(g) for g in groups.values())
    # Always on: without it, KubeRay deletes pods of its own choosing when a group shrinks.
    assert cluster["enableInTreeAutoscaling"] is True
    options = cluster["autoscalerOptions"]
    assert options["idleTimeoutSeconds"] == merged["rayAutoscaler"]["idleTimeoutSeconds"]


def test_multi_gpu_group_requests_its_gpus(chart):
    groups = _groups(_rayservice(_render(chart, MULTI_GPU_TP)))
    prefill = groups["prefill"]["template"]["spec"]["containers"][0]
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 3
    assert prefill["image"] == "registry.example.com/baton:0.1.0-cuda"
    args = _serve_config(_rayservice(_render(chart, MULTI_GPU_TP)))["applications"][0]["args"]
    assert args["prefill"]["tensor_parallel_size"] == 3 and args["prefill"]["num_gpus"] == 1


def _upgraded(chart, set_string: str):
    """The RayService before and after `helm upgrade --set <set_string>` on the defaults,
    and the after's deployment overrides by name (edit them back to compare)."""
    before = _rayservice(_render(chart, {}))
    after = _rayservice(_render(chart, helm.parse_set_string(set_string)))
    (app_after,) = _serve_config(after)["applications"]
    return before, after, {d["name"]: d for d in app_after["deployments"]}


def _same_but_overrides(before, after, scale) -> bool:
    """Whether the two differ in nothing but what `scale` was edited back from."""
    (app_before,) = _serve_config(before)["applications"]
    (app_after,) = _serve_config(after)["applications"]
    app_after["deployments"] = list(scale.values())
    if app_after != app_before:
        return False
    del before["spec"]["serveConfigV2"], after["spec"]["serveConfigV2"]
    return after == before


def test_one_value_scales_one_pool(chart):
    """`helm upgrade --set prefill.replicas=4` moves prefill's replicas (and so its pods)
    and nothing else: the application's args, which Serve versions every replica by, and
    the worker groups' bounds, which KubeRay would not apply to a running cluster, stay
    the same."""
    before, after, scale = _upgraded(chart, "prefill.replicas=4")
    assert scale["PrefillServer"]["num_replicas"] == 4
    scale["PrefillServer"]["num_replicas"] = 1
    groups = _groups(after)
    assert groups["prefill"]["replicas"] == 4
    groups["prefill"]["replicas"] = 1  # the group's starting size; its bounds are unchanged
    assert _same_but_overrides(before, after, scale)


def test_routers_may_be_left_to_serve_to_place(chart):
    """router.onHead=false: the head offers nothing, routers ask for what rayResources says
    (e.g. a head at num-cpus 0 and routers on a pool's pods)."""
    values = {
        "router": {"onHead": False, "rayResources": {"baton_decode": 0.01}},
        "head": {"rayStartParams": {"num-cpus": "0"}},
    }
    rayservice = _rayservice(_render(chart, values))
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert "resources" not in head and head["num-cpus"] == "0"
    router = app_config_of(_serve_config(rayservice)["applications"][0]).router
    assert router.resources == {"baton_decode": 0.01}


def test_one_value_scales_the_routers(chart):
    """`helm upgrade --set router.replicas=2` moves the router's replica count (a
    deployment override, which Serve applies in place), and nothing else: no argument, no
    pool's limits, no pod."""
    before, after, scale = _upgraded(chart, "router.replicas=2")
    assert scale["Router"]["num_replicas"] == 2
    assert "max_ongoing_requests" not in scale["DecodeServer"]
    scale["Router"]["num_replicas"] = 1
    assert _same_but_overrides(before, after, scale)


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
