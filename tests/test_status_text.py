"""serve_app/ops/status_text.py: `baton status`'s text for a report, including replicas of
an older release that post fewer fields (the whole path runs in test_service.py)."""

from __future__ import annotations

import pytest

from serve_app.config import PoolConfig
from serve_app.gpu_telemetry import GpuDevice, GpuReport
from serve_app.ops.status_text import DEFAULT_ACTIVATIONS, status_lines


def _engine(free: int, total: int = 64, running: int = 0, hit_rate: float = 0.0) -> dict:
    return {
        "num_running": running,
        "num_waiting": 1,
        "num_free_blocks": free,
        "num_total_blocks": total,
        "prefix_cache_hit_rate": hit_rate,
    }


def _report(*replicas: dict) -> dict:
    return {
        "application": "baton",
        "status": "RUNNING",
        "deployments": {"DecodeServer": {"status": "HEALTHY", "replicas": {"RUNNING": 2}}},
        "replicas": list(replicas),
    }


def test_each_replica_shows_its_role_dtype_tp_load_kv_and_handoffs():
    gpu = GpuDevice(
        0, "H100", memory_used_bytes=3 * 2**30, memory_total_bytes=80 * 2**30, utilization=0.42
    )
    decode = {
        "role": "decode",
        "replica_id": "abc",
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "engine": _engine(free=40, running=3, hit_rate=0.5),
        "handoff": {"num_handoffs": 7, "num_local_prefills": 2},
        "gpus": GpuReport(True, devices=[gpu]).to_dict(),
    }
    lines = status_lines(_report(decode))
    assert lines[0] == "application baton: RUNNING"
    assert lines[1].split() == ["DecodeServer", "HEALTHY", "replicas", "{'RUNNING':", "2}"]
    replica = lines[2].split()
    assert replica[:4] == ["decode", "abc", "bfloat16", "tp2"]
    assert "running 3" in " ".join(replica) and "KV 24/64 blocks" in lines[2]
    assert "prefix hit rate 0.50" in lines[2]
    assert lines[2].endswith("handoffs 7, local prefills 2")
    assert lines[3].strip() == "GPU 0 H100: memory 3.0/80.0 GiB, utilization 42%"
    assert len(lines) == 4


def test_a_replica_of_an_older_release_and_one_without_gpus_are_shown_as_far_as_known():
    older = {
        "role": "prefill",
        "replica_id": "old",
        "engine": _engine(free=64),
        "handoff": {"num_handoffs": 0},
    }
    cpu = {
        **older,
        "replica_id": "cpu",
        "dtype": "float32",
        "tensor_parallel_size": 1,
        "gpus": GpuReport(False, "no NVIDIA GPU here").to_dict(),
    }
    lines = status_lines(_report(older, cpu))
    assert lines[2].split()[:4] == ["prefill", "old", "?", "tp?"]
    assert "local prefills" not in lines[2] and lines[2].endswith("handoffs 0")
    assert lines[3].strip() == "GPUs: none (not reported)"
    assert lines[4].split()[:4] == ["prefill", "cpu", "float32", "tp1"]
    assert lines[5].strip() == "GPUs: none (no NVIDIA GPU here)"


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_a_replica_on_other_than_the_default_activations_says_so(activations):
    replica = {
        "role": "decode",
        "replica_id": "q",
        "dtype": "float32",
        "tensor_parallel_size": 1,
        "activations": activations,
        "engine": _engine(free=64),
        "handoff": {"num_handoffs": 0},
    }
    assert status_lines(_report(replica))[2].split()[:6] == [
        *("decode", "q", "float32", "tp1", f"activations={activations}", "running"),
    ]


def test_the_default_activations_go_unsaid():
    assert PoolConfig().activations == DEFAULT_ACTIVATIONS == "exact"
    older = {  # an older release's replica posts none
        "role": "decode",
        "replica_id": "q",
        "dtype": "float32",
        "tensor_parallel_size": 1,
        "engine": _engine(free=64),
        "handoff": {"num_handoffs": 0},
    }
    for replica in (older, {**older, "activations": DEFAULT_ACTIVATIONS}):
        line = status_lines(_report(replica))[2]
        assert "activations" not in line and line.split()[4] == "running"


def test_why_an_application_or_deployment_is_not_running_is_shown_and_imports_wait():
    report = _report(
        {
            "role": "decode",
            "replica_id": "d",
            "engine": {**_engine(free=64), "imports_waiting": 2},
            "handoff": {"num_handoffs": 0},
        }
    )
    report["status"] = "DEPLOYING"
    report["message"] = "Deploying app 'baton' failed"
    report["deployments"]["DecodeServer"]["message"] = "1 replica could not be placed"
    lines = status_lines(report)
    assert lines[1].strip() == "Deploying app 'baton' failed"
    assert lines[3].strip() == "1 replica could not be placed"
    assert "waiting   3" in lines[4]  # one queued request and two imports waiting for blocks


def test_degraded_mode_is_said_for_the_application_and_each_decode_replica_in_it():
    decode = {
        "role": "decode",
        "replica_id": "d",
        "engine": _engine(free=64),
        "handoff": {"num_handoffs": 3, "num_local_prefills": 1, "prefill_pool_down": True},
    }
    report = _report(decode)
    report["deployments"]["PrefillServer"] = {"status": "UNHEALTHY", "replicas": {"STARTING": 1}}
    lines = status_lines(report)
    assert lines[1].strip() == (
        "degraded: no prefill replica is running; decode replicas prefill new requests"
    )
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["decode", "d"])
    assert lines[at + 1].strip() == (
        "degraded mode: prefilling new requests here (no prefill replica)"
    )
    # Running again: neither line.
    report["deployments"]["PrefillServer"]["replicas"] = {"RUNNING": 1}
    decode["handoff"]["prefill_pool_down"] = False
    assert not any("degraded" in line for line in status_lines(report))
