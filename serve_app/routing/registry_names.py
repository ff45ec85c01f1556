"""Where the prefix registries live: their Ray namespace, an application's own registry's
name, and their removal. Apart from the registry itself (prefix_registry.py, whose index
checks the engine's block hashes), so that `baton stop` reaches them without loading
any engine code."""

from __future__ import annotations

import ray

# The Ray namespace of every registry actor (the status board's too).
REGISTRY_NAMESPACE = "baton"
# What an application's own registry is named after (`app_registry_name`).
REGISTRY_NAME_PREFIX = "baton-prefix-registry"


def app_registry_name(app_name: str) -> str:
    """The name of Serve application `app_name`'s own registry: what its router and
    replicas use unless its config names one (`AppConfig.registry_name`). Distinct for
    distinct applications, so no application's routing hears of another's replicas."""
    return f"{REGISTRY_NAME_PREFIX}-{app_name}"


def remove_registry(name: str, namespace: str = REGISTRY_NAMESPACE) -> bool:
    """Kills the named registry actor for good (Ray must be initialised); False if there
    is none. For an application's own registry once the application is deleted: while
    any of its replicas or routers runs, they would only start a new, empty one."""
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True
