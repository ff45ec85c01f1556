"""GPU telemetry from NVML (`nvidia-ml-py`): memory and utilization per device.

On a machine without an NVIDIA driver NVML cannot start; the report says so plainly
(`available=False` and the reason) and everything else carries on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float  # 0..1, over NVML's last sample period


@dataclass(frozen=True)
class GpuReport:
    available: bool
    reason: str = ""  # why there is nothing to report, when not available
    devices: list[GpuDevice] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def read_gpus() -> GpuReport:
    try:
        import pynvml
    except ImportError as e:  # a dependency of the package; only a broken install lacks it
        return GpuReport(False, f"nvidia-ml-py is not installed ({e})")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return GpuReport(False, f"no NVIDIA GPU here (NVML: {e})")
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            devices.append(
                GpuDevice(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_used_bytes=int(memory.used),
                    memory_total_bytes=int(memory.total),
                    utilization=pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
                )
            )
        return GpuReport(True, devices=devices)
    except pynvml.NVMLError as e:
        return GpuReport(False, f"NVML failed to read the devices ({e})")
    finally:
        pynvml.nvmlShutdown()
