"""GPU telemetry from NVML (`nvidia-ml-py`): memory and utilization per device.

NVML sees every device of the machine whatever CUDA_VISIBLE_DEVICES says, so a process
reports only the devices that variable gives it (Ray sets it for an actor that asks for
GPUs), by index or UUID, as CUDA counts them: replicas sharing a node then do not each
report, and add up, all of its GPUs. On a machine without an NVIDIA driver NVML cannot
start; the report says so plainly (`available=False` and the reason) and everything else
carries on.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class GpuDevice:
    index: int  # NVML's, the machine's numbering
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float | None  # 0..1 over NVML's last sample; None where NVML has none (MIG)


@dataclass(frozen=True)
class GpuReport:
    available: bool
    reason: str = ""  # why there is nothing to report, when not available
    devices: list[GpuDevice] = field(default_factory=list)
    # Not available for now (a read failed), as opposed to no driver or no GPU given:
    # worth reading again.
    transient: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def replica_gpus(num_gpus: float, visible: str | None = None) -> GpuReport:
    """A pool replica's report: of the GPUs `visible` names (a TP replica: its ranks',
    which Ray gave them and not the replica), by default of the replica's own process.
    Ray sets CUDA_VISIBLE_DEVICES only for an actor that asks for GPUs; one that does not
    would see, and report, every GPU of its node."""
    if num_gpus == 0:
        return GpuReport(False, "this pool's replicas use no GPU")
    return read_gpus(visible)


def read_gpus(visible: str | None = None) -> GpuReport:
    """The devices `visible` (CUDA_VISIBLE_DEVICES' syntax; by default the variable,
    and unset means every device) names."""
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    wanted = None if visible is None else [v.strip() for v in visible.split(",") if v.strip()]
    if wanted == []:
        return GpuReport(False, "no GPU is given to this process (CUDA_VISIBLE_DEVICES is empty)")
    try:
        import pynvml
    except ImportError as e:  # a dependency of the package; only a broken install lacks it
        return GpuReport(False, f"nvidia-ml-py is not installed ({e})")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return GpuReport(False, f"no NVIDIA GPU here (NVML: {e})")
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        chosen = list(enumerate(handles)) if wanted is None else _visible(handles, wanted)
        if not chosen:
            return GpuReport(
                False,
                f"CUDA_VISIBLE_DEVICES={visible} names no device NVML lists "
                "(MIG slices are not reported)",
            )
        return GpuReport(True, devices=[_device(i, h) for i, h in chosen])
    except pynvml.NVMLError as e:
        return GpuReport(False, f"NVML failed to read the devices ({e})", transient=True)
    finally:
        pynvml.nvmlShutdown()


def _visible(handles: list, wanted: list[str]) -> list[tuple[int, object]]:
    """(index, handle) of each device `wanted` names, in its order: an index, or a UUID
    or a unique prefix of one (as CUDA takes them). CUDA stops at the first entry that
    names no device, and so does this."""
    import pynvml

    uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
    chosen = []
    for entry in wanted:
        if entry.isdigit():
            index = int(entry)
        else:
            matches = [i for i, u in enumerate(uuids) if u.startswith(entry)]
            index = matches[0] if len(matches) == 1 else -1
        if not 0 <= index < len(handles):
            break
        chosen.append((index, handles[index]))
    return chosen


def _device(index: int, handle) -> GpuDevice:
    import pynvml

    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        utilization = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
    except pynvml.NVMLError_NotSupported:  # a MIG slice has no utilization of its own
        utilization = None
    return GpuDevice(
        index=index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_used_bytes=int(memory.used),
        memory_total_bytes=int(memory.total),
        utilization=utilization,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
