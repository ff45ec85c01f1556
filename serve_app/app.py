"""`build_app(config) -> Application`: the deployments of one Baton service, wired by bind().

Usable from a Serve config file (`import_path: serve_app.app:build_app`, the AppConfig's
fields as `args`) and from Python (`serve.run(build_app(AppConfig(...)))`, as `baton
serve` does).

    disaggregated:  Router -> DecodeServer -> PrefillServer   (decode drives the handoff)
    aggregated:     Router -> EngineServer
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig as ServeAutoscaling
from ray.serve.config import RequestRouterConfig

from serve_app.code_version import source_digest
from serve_app.config import AppConfig, PoolConfig
from serve_app.engine_server import EngineServer
from serve_app.router import Router
from serve_app.serve_config import DEPLOYMENT_NAMES, ROUTER_NAME, pool_scale
from workers.engine import check_transport
from workers.model import ModelConfig
from workers.runner import rank_bundle

# How often replicas report load and KV usage to the request router.
ROUTING_STATS_PERIOD_S = 1.0
HEALTH_CHECK_PERIOD_S = 2.0


def _pin_version(deployment, role: str, replica_args: AppConfig, code_version: str):
    """Pins the deployment's version to its code and its replicas' arguments.

    Serve's Python API gives every deployment a random version on each `serve.run`, so a
    redeploy that only changes a replica count would restart every replica of every
    pool. Pinned, Serve sees the other deployments unchanged and only adds or drains
    replicas of the pool being scaled. (Serve dropped the public `version` option and
    computes its own only for config-file deploys, hence the attribute.)
    """
    text = json.dumps([code_version, role, replica_args.model_dump(mode="json")])
    deployment._version = hashlib.sha256(text.encode()).hexdigest()[:16]
    return deployment


def _pool_options(role: str, pool: PoolConfig) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAMES[role],
        "max_ongoing_requests": pool.max_ongoing_requests,
        "max_queued_requests": -1 if pool.max_queued_requests is None else pool.max_queued_requests,
        "ray_actor_options": {
            "num_cpus": pool.num_cpus,
            # TP ranks take the devices; the replica process itself needs one only at tp=1.
            "num_gpus": pool.num_gpus if pool.tensor_parallel_size == 1 else 0,
            "resources": dict(pool.resources),
        },
        "request_router_config": RequestRouterConfig(
            request_router_class="serve_app.routing.request_router:KVAwareRequestRouter",
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
        # Loading a model takes a while; a busy CPU engine must not look dead. A failed
        # engine is replaced after three failed checks (~6 s, not Serve's default ~30 s);
        # the request router stops sending it requests sooner (serve_app/routing/request_router.py).
        "health_check_timeout_s": 60,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "graceful_shutdown_timeout_s": pool.graceful_shutdown_timeout_s,
    }
    if pool.tensor_parallel_size > 1:
        # Each replica is reserved with its ranks, as one placement group on one node
        # (the ranks exchange activations twice per layer): it lands only on a node
        # where they fit (one with the GPUs they need), and Ray's autoscaler asks for
        # the whole at once. The engine puts rank r in bundle r + 1 (tp_placement).
        replica = {"CPU": pool.num_cpus, **pool.resources}
        options["placement_group_bundles"] = [
            {name: amount for name, amount in replica.items() if amount > 0},
            *[rank_bundle(pool.num_gpus > 0)] * pool.tensor_parallel_size,
        ]
        options["placement_group_strategy"] = "STRICT_PACK"
    scale = pool_scale(pool)
    if "autoscaling_config" in scale:
        options["autoscaling_config"] = ServeAutoscaling(**scale["autoscaling_config"])
    else:
        options["num_replicas"] = scale["num_replicas"]
    return options


def validate(config: AppConfig) -> None:
    """Checks that need the model (TP degrees) or the environment (the transport's
    package); ValueError naming the field."""
    if config.mode == "disaggregated":
        check_transport(config.kv_transport(), "transport")
    model = ModelConfig.from_pretrained(config.model_dir())
    for role, pool in config.pools().items():
        model.check_tp_degree(pool.tensor_parallel_size, f"{role}.tensor_parallel_size")
        if pool.num_replicas < 1 and pool.autoscaling is None:
            raise ValueError(f"{role}.num_replicas must be >= 1 (or set {role}.autoscaling)")
    config.context_length(config.model_dir())  # a max_model_len no KV cache can hold


def build_app(args: AppConfig | dict[str, Any] | None = None) -> Application:
    """The application for `args` (a config file's `args`, or an AppConfig). Serve calls
    a builder with that one argument only."""
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    return build_versioned_app(config, source_digest())


def build_versioned_app(config: AppConfig, code_version: str) -> Application:
    """`build_app` with the deployments' versions standing for `code_version`: `baton
    scale` passes the one the service was deployed with, so that code edited since
    does not roll every pool."""
    validate(config)
    # Replicas never see replica counts: a rescale then leaves every deployment's
    # arguments as they were, and Serve adds or drains replicas instead of restarting.
    replica_args = config.without_scale()
    router_deployment = serve.deployment(Router).options(
        name=ROUTER_NAME,
        num_replicas=config.router.num_replicas,
        max_ongoing_requests=config.router.max_ongoing_requests,
        # A router being replaced (a drained node, a rescale) relays its streams to their
        # end: as long as the longest a pool replica may take to finish them.
        graceful_shutdown_timeout_s=max(
            p.graceful_shutdown_timeout_s for p in config.pools().values()
        ),
        ray_actor_options={
            "num_cpus": config.router.num_cpus,
            "resources": dict(config.router.resources),
        },
    )
    router = _pin_version(router_deployment, "router", replica_args, code_version)
    engine = serve.deployment(EngineServer)

    def pool(role: str, *extra: Any):
        options = _pool_options(role, config.pools()[role])
        deployment = _pin_version(engine.options(**options), role, replica_args, code_version)
        return deployment.bind(replica_args, role, *extra)

    if config.mode == "aggregated":
        return router.bind(replica_args, pool("aggregated"))
    return router.bind(replica_args, pool("decode", pool("prefill")))
