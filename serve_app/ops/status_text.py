"""`baton status`'s text: one line per deployment, then per replica its role, dtype, TP
degree, activations (where not the default), load, KV blocks in use, prefix hit rate and
handoffs, and its GPUs.

Reports come from `service_ops.status()`, whose replica entries are what each replica
last posted to the status board: during a rolling upgrade some are an older release's,
so fields added since are read with a default.
"""

from __future__ import annotations

from serve_app.serve_config import DEPLOYMENT_NAMES

# PoolConfig.activations' default (tests/test_status_text.py holds them equal), which the
# text leaves out, so that a line shows activations=int16 or int8 (a replica whose greedy
# output may part from exact's) and not exact; spelled out so that `baton status` needs
# no pydantic model to print.
DEFAULT_ACTIVATIONS = "exact"


def _activations(replica: dict) -> str:
    # .get: a replica of an older release, mid rolling upgrade, does not post them.
    activations = replica.get("activations", DEFAULT_ACTIVATIONS)
    return f" activations={activations}" if activations != DEFAULT_ACTIVATIONS else ""


def _local_prefills(handoff: dict) -> str:
    # .get: a replica of an older release, mid rolling upgrade, does not count them.
    n = handoff.get("num_local_prefills", 0)
    return f", local prefills {n}" if n else ""


def _degraded(report: dict) -> str | None:
    """Why the application serves degraded, by Serve's view of its pools, if it does."""
    pools = {name: d["replicas"].get("RUNNING", 0) for name, d in report["deployments"].items()}
    if pools.get(DEPLOYMENT_NAMES["prefill"]) == 0 and pools.get(DEPLOYMENT_NAMES["decode"]):
        return "degraded: no prefill replica is running; decode replicas prefill new requests"
    return None


def status_lines(report: dict) -> list[str]:
    """`baton status`'s text for a `service_ops.status()` report."""
    lines = [f"application {report['application']}: {report['status']}"]
    if report.get("message"):
        lines.append(f"  {report['message']}")
    if degraded := _degraded(report):
        lines.append(f"  {degraded}")
    for name, d in report["deployments"].items():
        lines.append(f"  {name:<14} {d['status']:<10} replicas {d['replicas']}")
        if d.get("message"):
            lines.append(f"    {d['message']}")
    for r in report["replicas"]:
        e = r["engine"]
        used = e["num_total_blocks"] - e["num_free_blocks"]
        # Handed-over requests waiting for blocks wait too (as vllm_num_requests_waiting).
        waiting = e["num_waiting"] + e.get("imports_waiting", 0)
        lines.append(
            # .get: a replica of an older release, mid rolling upgrade, posts neither.
            f"  {r['role']:<10} {r['replica_id']:<10} {r.get('dtype', '?')} "
            f"tp{r.get('tensor_parallel_size', '?')}"
            f"{_activations(r)}  "
            f"running {e['num_running']:>3} "
            f"waiting {waiting:>3}  KV {used}/{e['num_total_blocks']} blocks  "
            f"prefix hit rate {e['prefix_cache_hit_rate']:.2f}  "
            f"handoffs {r['handoff']['num_handoffs']}"
            f"{_local_prefills(r['handoff'])}"
        )
        if r["handoff"].get("prefill_pool_down"):
            lines.append("    degraded mode: prefilling new requests here (no prefill replica)")
        gpus = r.get("gpus", {})
        if not gpus.get("available"):
            lines.append(f"    GPUs: none ({gpus.get('reason', 'not reported')})")
        for d in gpus.get("devices", []):
            busy = "n/a" if d["utilization"] is None else f"{d['utilization']:.0%}"
            lines.append(
                f"    GPU {d['index']} {d['name']}: memory {d['memory_used_bytes'] / 2**30:.1f}"
                f"/{d['memory_total_bytes'] / 2**30:.1f} GiB, utilization {busy}"
            )
    return lines
