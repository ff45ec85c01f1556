"""GPU telemetry: a plain "none" without a driver, NVML's readings converted with one."""

from __future__ import annotations

import types

import pynvml
import pytest

from serve_app.gpu_telemetry import read_gpus, replica_gpus


def test_without_an_nvidia_driver_the_report_says_so(monkeypatch):
    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    report = read_gpus()
    assert not report.available and "no NVIDIA GPU" in report.reason and not report.devices


def _fake_nvml(monkeypatch, count: int = 2, mig: tuple[int, ...] = ()) -> list[str]:
    """NVML of `count` devices (handle i is device i; the ones in `mig` have no
    utilization); returns the calls to init and shutdown."""
    calls = []

    def utilization(h):
        if h in mig:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return types.SimpleNamespace(gpu=50 + h)

    fake = {
        "nvmlInit": lambda: calls.append("init"),
        "nvmlShutdown": lambda: calls.append("shutdown"),
        "nvmlDeviceGetCount": lambda: count,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetUUID": lambda h: f"GPU-{h}a{h}b-0000",
        "nvmlDeviceGetName": lambda h: b"NVIDIA H100" if h == 0 else "NVIDIA H200",
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(
            used=2**30 * (h + 1), total=2**36
        ),
        "nvmlDeviceGetUtilizationRates": utilization,
    }
    for name, fn in fake.items():
        monkeypatch.setattr(pynvml, name, fn)
    return calls


def test_readings_are_converted_per_device(monkeypatch):
    calls = _fake_nvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    report = read_gpus()  # unset: every device
    assert report.available and [d.name for d in report.devices] == ["NVIDIA H100", "NVIDIA H200"]
    assert report.devices[1].memory_used_bytes == 2 * 2**30
    assert report.devices[0].utilization == pytest.approx(0.5)
    assert calls == ["init", "shutdown"]


def test_a_process_reports_only_the_devices_cuda_visible_devices_gives_it(monkeypatch):
    _fake_nvml(monkeypatch, count=4)

    def indices(visible: str) -> list[int]:
        return [d.index for d in read_gpus(visible).devices]

    assert indices("2") == [2] and indices("3,1") == [3, 1]
    assert indices("GPU-1a1b-0000") == [1] and indices("GPU-2a") == [2]  # a UUID or prefix
    assert indices("1,7,2") == [1]  # CUDA stops at an entry that names no device
    for names_none in ("GPU-", "MIG-4f5e6a7b", "NoDevFiles"):  # "GPU-": a prefix of several
        report = read_gpus(names_none)
        assert not report.available and "names no device" in report.reason, names_none
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert indices(None) == [0, 2]
    given_none = read_gpus("")
    assert not given_none.available and "no GPU is given" in given_none.reason
    assert not given_none.transient


def test_a_mig_slice_has_no_utilization_and_a_failed_read_is_tried_again(monkeypatch):
    _fake_nvml(monkeypatch, mig=(1,))
    report = read_gpus("0,1")
    assert [d.utilization for d in report.devices] == [pytest.approx(0.5), None]

    def broken(h):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", broken)
    failed = read_gpus("0")
    assert not failed.available and failed.transient and "NVML failed" in failed.reason


def test_this_machine_reports_without_raising():
    report = read_gpus()
    # Either devices were read or the reason there are none is spelled out.
    assert report.available or (report.reason and not report.devices)
    assert report.to_dict()["available"] == report.available


def test_a_replica_without_gpus_of_its_own_reports_none_rather_than_its_nodes(monkeypatch):
    _fake_nvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # as Ray leaves it for them
    cpu = replica_gpus(num_gpus=0)
    assert not cpu.available and "use no GPU" in cpu.reason
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [d.index for d in replica_gpus(num_gpus=1).devices] == [1]
    # A TP replica holds no GPU itself (Ray leaves it none): it reports its ranks'.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not replica_gpus(num_gpus=1).available
    assert [d.index for d in replica_gpus(num_gpus=1, visible="1,0").devices] == [1, 0]
