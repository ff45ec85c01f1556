"""GPU telemetry: a plain "none" without a driver, NVML's readings converted with one."""

from __future__ import annotations

import types

import pynvml
import pytest

from serve_app.gpu_telemetry import read_gpus


def test_without_an_nvidia_driver_the_report_says_so(monkeypatch):
    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    report = read_gpus()
    assert not report.available and "no NVIDIA GPU" in report.reason and not report.devices


def test_readings_are_converted_per_device(monkeypatch):
    calls = []
    fake = {
        "nvmlInit": lambda: calls.append("init"),
        "nvmlShutdown": lambda: calls.append("shutdown"),
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: b"NVIDIA H100" if h == 0 else "NVIDIA H200",
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(
            used=2**30 * (h + 1), total=2**36
        ),
        "nvmlDeviceGetUtilizationRates": lambda h: types.SimpleNamespace(gpu=50 + h),
    }
    for name, fn in fake.items():
        monkeypatch.setattr(pynvml, name, fn)
    report = read_gpus()
    assert report.available and [d.name for d in report.devices] == ["NVIDIA H100", "NVIDIA H200"]
    assert report.devices[1].memory_used_bytes == 2 * 2**30
    assert report.devices[0].utilization == pytest.approx(0.5)
    assert calls == ["init", "shutdown"]


def test_this_machine_reports_without_raising():
    report = read_gpus()
    # Either devices were read or the reason there are none is spelled out.
    assert report.available or (report.reason and not report.devices)
    assert report.to_dict()["available"] == report.available
