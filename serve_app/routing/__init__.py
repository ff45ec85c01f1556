"""Where a request goes: the cluster-wide prefix registry (prefix_registry.py) and the
cache-aware replica choice plugged into Serve's request router (request_router.py)."""
