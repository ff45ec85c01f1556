"""The Serve config (the file `serve deploy` takes, KubeRay's serveConfigV2) for an AppConfig.

`baton serve` and the Helm chart both deploy exactly this: one application built by
`build_app` from the AppConfig's fields, Serve's HTTP proxy on 8000 and its gRPC proxy
on 9000 with Baton's service, the standard health service and server reflection (v1 and
v1alpha).

Replica counts and autoscaling are not in the application's `args` but in its
`deployments:` overrides. Serve versions every deployment of a config-file application
by a hash of its `args`, so a count there would make `helm upgrade --set
prefill.replicas=4` restart every replica of every pool; as an override it changes only
the prefill deployment's target, and Serve adds replicas beside the running ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Only named in annotations: the names below (ports, the application's name, message
    # limit) are what the `baton` client commands import, and config.py is pydantic's.
    from serve_app.config import AppConfig, PoolConfig

IMPORT_PATH = "serve_app.app:build_app"
APP_NAME = "baton"
HTTP_PORT = 8000
GRPC_PORT = 9000
# The largest request either API takes (an HTTP body, a gRPC message; gRPC's limit is the
# response's too): far above any prompt a context holds, far below what would stall a
# router to decode (Serve's own gRPC limit is 2 GiB).
MAX_REQUEST_BYTES = 16 * 2**20
DEPLOYMENT_NAMES = {
    "aggregated": "EngineServer",
    "prefill": "PrefillServer",
    "decode": "DecodeServer",
}
ROUTER_NAME = "Router"
# Services Serve's gRPC proxy registers and routes to the router deployment (a method of
# the same name answers each RPC). Server reflection is the gRPC server's own: v1alpha is
# Serve's (enable_reflection), v1 Baton's (grpc/reflection.py), registered last so that it
# lists the services before it.
GRPC_SERVICER_FUNCTIONS = (
    "serve_app.grpc.servicer.add_baton_servicer_to_server",
    "serve_app.grpc.servicer.add_health_servicer_to_server",
    "serve_app.grpc.reflection.add_reflection_v1_to_server",
)


def serve_config(
    config: AppConfig, *, http_port: int = HTTP_PORT, grpc_port: int = GRPC_PORT
) -> dict[str, Any]:
    """A dict that `ray.serve.schema.ServeDeploySchema` accepts, deploying `config`."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": http_port},
        "grpc_options": {
            "port": grpc_port,
            "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS),
            "enable_reflection": True,
        },
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": config.without_scale().model_dump(mode="json", exclude_defaults=True),
                "deployments": [
                    {"name": ROUTER_NAME, "num_replicas": config.router.num_replicas},
                    *(
                        {"name": DEPLOYMENT_NAMES[role], **pool_scale(pool)}
                        for role, pool in config.pools().items()
                    ),
                ],
            }
        ],
    }


def pool_scale(pool: PoolConfig) -> dict[str, Any]:
    """Serve's replica-count options for one pool: a fixed `num_replicas`, or an
    `autoscaling_config` that starts at `num_replicas` (clamped to its bounds)."""
    if pool.autoscaling is None:
        return {"num_replicas": pool.num_replicas}
    a = pool.autoscaling
    return {
        # Explicitly unset: an override merges into what build_app set (one replica).
        "num_replicas": None,
        "autoscaling_config": {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "initial_replicas": min(max(pool.num_replicas, a.min_replicas), a.max_replicas),
            "target_ongoing_requests": a.target_ongoing_requests,
        },
    }
