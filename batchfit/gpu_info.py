"""``batchfit devices``: what an ML engineer checks with nvidia-smi before a run, through NVML.

Each GPU's name, total/used/free memory, utilisation, and the processes holding memory on it.
Memory that other processes hold is invisible to torch's allocator but not to the probe's
budget, so this is the first thing to look at when a probe finds less than expected.

Reads only; returns data (:class:`DevicesReport`) and leaves printing to the CLI. On a machine
without an NVIDIA driver (or without ``nvidia-ml-py``) the report carries a one-line reason in
``unavailable`` instead of raising: no GPU is an answer, not an error. NVML is always shut down
again, whatever happens after ``nvmlInit``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU (``used_bytes`` is ``None`` where NVML cannot say,
    e.g. for another container's process or under Windows WDDM)."""

    pid: int
    name: str
    used_bytes: int | None
    kind: str  # "compute" or "graphics"


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML sees it. Fields NVML does not support on this device are ``None``."""

    index: int
    name: str
    uuid: str | None
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    gpu_utilization: int | None  # percent of time a kernel ran over the last sample period
    memory_utilization: int | None  # percent of time memory was read or written
    temperature_c: int | None
    power_w: float | None
    processes: tuple[GpuProcess, ...]


@dataclass(frozen=True)
class DevicesReport:
    """Every GPU NVML lists, or why there is nothing to list."""

    gpus: tuple[Gpu, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    cuda_visible_devices: str | None = None
    unavailable: str | None = None


def query_devices() -> DevicesReport:
    """Ask NVML about every GPU. Never raises for a missing driver or library."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        import pynvml
    except ImportError:
        return DevicesReport(
            cuda_visible_devices=visible,
            unavailable="cannot list GPUs: nvidia-ml-py (pynvml) is not installed",
        )
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return DevicesReport(cuda_visible_devices=visible, unavailable=_why_unavailable(pynvml, exc))
    try:
        gpus = tuple(_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount()))
        return DevicesReport(
            gpus=gpus,
            driver_version=_optional(pynvml, lambda: _text(pynvml.nvmlSystemGetDriverVersion())),
            cuda_version=_optional(pynvml, lambda: _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion())),
            cuda_visible_devices=visible,
            unavailable=None if gpus else "the NVIDIA driver is loaded but lists no GPU",
        )
    finally:
        pynvml.nvmlShutdown()


def _why_unavailable(pynvml: Any, exc: Exception) -> str:
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
        return "no NVIDIA GPU: the NVIDIA driver is not installed (libnvidia-ml not found); batchfit probes run on CPU"
    if isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
        return "no NVIDIA GPU: the NVIDIA driver is installed but not loaded; batchfit probes run on CPU"
    if isinstance(exc, pynvml.NVMLError_NoPermission):
        return "cannot list GPUs: no permission to talk to the NVIDIA driver"
    return f"cannot list GPUs: NVML failed to start ({exc})"


def _gpu(pynvml: Any, index: int) -> Gpu:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = _optional(pynvml, lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    rates = _optional(pynvml, lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
    power_mw = _optional(pynvml, lambda: pynvml.nvmlDeviceGetPowerUsage(handle))
    return Gpu(
        index=index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        uuid=_optional(pynvml, lambda: _text(pynvml.nvmlDeviceGetUUID(handle))),
        total_bytes=None if memory is None else int(memory.total),
        used_bytes=None if memory is None else int(memory.used),
        free_bytes=None if memory is None else int(memory.free),
        gpu_utilization=None if rates is None else int(rates.gpu),
        memory_utilization=None if rates is None else int(rates.memory),
        temperature_c=_optional(
            pynvml, lambda: int(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
        ),
        power_w=None if power_mw is None else power_mw / 1000.0,
        processes=_processes(pynvml, handle),
    )


def _processes(pynvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    found: dict[int, GpuProcess] = {}
    for kind, query in (
        ("compute", pynvml.nvmlDeviceGetComputeRunningProcesses),
        ("graphics", pynvml.nvmlDeviceGetGraphicsRunningProcesses),
    ):
        for proc in _optional(pynvml, lambda q=query: q(handle)) or ():  # type: ignore[misc]
            pid = int(proc.pid)
            if pid in found:  # a process can be listed as both; keep the first
                continue
            used = getattr(proc, "usedGpuMemory", None)
            found[pid] = GpuProcess(pid=pid, name=_process_name(pynvml, pid), used_bytes=used, kind=kind)
    return tuple(found.values())


def _process_name(pynvml: Any, pid: int) -> str:
    """NVML's name for ``pid``; inside a container the pid may be the host's, so fall back to
    ``/proc`` and then to ``?``."""
    name = _optional(pynvml, lambda: _text(pynvml.nvmlSystemGetProcessName(pid)))
    if name:
        return name
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as comm:
            return comm.read().strip() or "?"
    except OSError:
        return "?"


def _optional(pynvml: Any, query: Callable[[], T]) -> T | None:
    """``query()``, or ``None`` where NVML says the device does not support it (MIG, vGPU, old
    boards) or the call is not permitted."""
    try:
        return query()
    except pynvml.NVMLError:
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_version(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"
