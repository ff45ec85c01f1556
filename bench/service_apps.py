"""The applications bench/service.py deploys, by name, and the deploying of one at a
time (each shares the machine only with what it brings)."""

from __future__ import annotations

import argparse

from common import log
from ray import serve

from serve_app.config import TRANSPORTS, AppConfig, PoolConfig
from serve_app.ops import service_ops
from serve_app.routing.registry_names import app_registry_name, remove_registry
from serve_app.serve_config import GRPC_SERVICER_FUNCTIONS


def app_configs(args: argparse.Namespace) -> dict[str, AppConfig]:
    """Every application the run measures, by name. Prefix caching is off everywhere:
    rounds repeat prompts, and hits would measure the cache rather than the serving path."""
    agg_pool = PoolConfig(num_threads=args.agg_threads, dtype=args.dtype)
    si = args.stream_interval
    apps = {}
    for suffix, interval in (("", 1), (f"_si{si}", si)):
        common = {"model": args.model, "enable_prefix_caching": False, "stream_interval": interval}
        apps[f"agg{suffix}"] = AppConfig(mode="aggregated", aggregated=agg_pool, **common)
        for transport in TRANSPORTS if interval == 1 else (AppConfig().kv_transport(),):
            apps[f"disagg_{transport}{suffix}"] = AppConfig(
                mode="disaggregated",
                transport=transport,
                prefill=PoolConfig(num_threads=args.prefill_threads, dtype=args.dtype),
                decode=PoolConfig(num_threads=args.decode_threads, dtype=args.dtype),
                **common,
            )
    # The router's other output channel, for comparison (config.OutputChannel).
    apps["agg_actor_call"] = apps["agg"].model_copy(update={"output_channel": "actor_call"})
    # Selective disaggregation: decode prefills what arrives while it already waits on
    # --max-pending-prefills prefills (a burst the single prefill replica would queue).
    apps["disagg_selective"] = apps[f"disagg_{AppConfig().kv_transport()}"].model_copy(
        update={"max_pending_prefills": args.max_pending_prefills}
    )
    return apps


# Serve's Python proxy as the ingress instead of HAProxy, for "agg_python_proxy".
PYTHON_PROXY_ENV = {**service_ops.SERVE_ENV, "RAY_SERVE_ENABLE_HA_PROXY": "0"}


class Deployed:
    """One application deployed for the length of a `with` block, then deleted; with
    `python_proxy`, on a Serve started for it whose ingress is Serve's Python proxy."""

    def __init__(self, name: str, config: AppConfig, ports: dict, python_proxy: bool) -> None:
        self.name, self.config, self.ports = name, config, ports
        self.python_proxy = python_proxy

    def __enter__(self) -> str:
        behind = " behind Serve's Python proxy" if self.python_proxy else ""
        log(f"deploying {self.name}{behind}")
        if self.python_proxy:
            # The ingress is the controller's setting, fixed when it starts: a Serve of
            # its own, which `deploy` then joins, and which goes when the block ends.
            serve.shutdown()
            serve.start(
                http_options={"host": self.ports["http_host"], "port": self.ports["http_port"]},
                grpc_options={
                    "port": self.ports["grpc_port"],
                    "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS),
                },
                controller_options={"runtime_env": {"env_vars": PYTHON_PROXY_ENV}},
            )
        try:
            service_ops.deploy(self.config, app_name=self.name, route_prefix="/", **self.ports)
        except BaseException:
            serve.delete(self.name)  # else it keeps route "/" and every later deploy fails
            raise
        return self.name

    def __exit__(self, *exc) -> None:
        serve.delete(self.name)
        # Its prefix registry outlives the application (as after `baton stop` without
        # its cleanup): an idle actor that would run beside every later one measured.
        remove_registry(app_registry_name(self.name))
        if self.python_proxy:
            serve.shutdown()  # the next application gets Serve's default ingress again
