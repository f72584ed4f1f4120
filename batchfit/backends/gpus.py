"""``batchfit devices``: what an ML engineer checks with nvidia-smi before a run, from NVML.

Each GPU's name, total/used/free memory, utilisation, MIG instances, the processes holding memory
on it, and the index torch would give it. Memory that other processes hold is invisible to torch's
allocator but not to the probe's budget, so this is the first thing to look at when a probe finds
less than expected. It only reads, and returns data; printing is the CLI's job. It never raises
for a missing library or driver or a failing NVML call (see `batchfit.backends.nvml`).

No torch import at import time: on a machine where NVML lists no GPU, torch is never imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from batchfit.backends.nvml import mig_handles, optional, reason, shutdown, text, uuid_key


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU. Frozen: a report is a snapshot, not live state.

    ``used_bytes`` is ``None`` where NVML cannot say, e.g. for another container's process or
    under Windows WDDM."""

    pid: int
    name: str
    used_bytes: int | None
    kind: str  # "compute" or "graphics"


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance of a GPU in MIG mode: a slice with its own memory, and its own UUID, which
    is what ``CUDA_VISIBLE_DEVICES`` and torch see instead of the parent GPU's.

    Frozen, like every part of the report. ``index`` is NVML's MIG slot on the parent GPU (not a
    CUDA index); ``unreadable`` is set, and the other fields ``None``, when NVML lists the slot but
    cannot open it."""

    index: int
    uuid: str | None
    name: str | None
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    cuda_index: int | None = None  # the index torch gives this instance, None when torch does not see it
    unreadable: str | None = None


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML sees it. Frozen: a report is a snapshot, not live state.

    ``index`` is NVML's (PCI bus order); ``cuda_index`` the one torch would use for the same GPU
    (``torch.device("cuda", cuda_index)``), ``None`` when torch does not see it or could not be
    asked. Fields NVML does not support on this device are ``None``. When NVML cannot even open
    the GPU, ``unreadable`` says why and every other field is ``None`` or empty: the GPU still
    appears, so a person sees that it exists and why it is not described."""

    index: int
    name: str | None
    uuid: str | None
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    gpu_utilization: int | None  # percent of time a kernel ran over the last sample period
    memory_utilization: int | None  # percent of time memory was read or written
    temperature_c: int | None
    power_w: float | None
    processes: tuple[GpuProcess, ...]
    mig_enabled: bool | None = None  # None where the GPU has no MIG support or NVML cannot say
    mig_devices: tuple[MigDevice, ...] = ()
    cuda_index: int | None = None
    unreadable: str | None = None


@dataclass(frozen=True)
class DevicesReport:
    """Every GPU NVML lists, or why there is nothing to list (``unavailable``, one line).

    Frozen, and made of plain values, so ``dataclasses.asdict`` gives the CLI's JSON as is.
    ``cuda_device_count`` is how many CUDA devices torch sees, ``None`` when torch was not asked
    (NVML listed no GPU) or could not answer; with it a GPU whose ``cuda_index`` is ``None`` can be
    told apart as hidden from torch rather than unknown."""

    gpus: tuple[Gpu, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    cuda_visible_devices: str | None = None
    cuda_device_order: str | None = None
    cuda_device_count: int | None = None
    unavailable: str | None = None


# The report ------------------------------------------------------------------------------------
def query_devices() -> DevicesReport:
    """Ask NVML about every GPU, then torch which CUDA index each has.

    Never raises for a missing library or driver or a failing NVML call. torch is imported only
    when NVML listed at least one GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = os.environ.get("CUDA_DEVICE_ORDER")
    unknown = DevicesReport(cuda_visible_devices=visible, cuda_device_order=order)
    try:
        import pynvml
    except ImportError:
        return replace(unknown, unavailable="cannot list GPUs: nvidia-ml-py (pynvml) is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return replace(unknown, unavailable=_why_unavailable(pynvml, exc))
    try:
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            return replace(unknown, unavailable=f"cannot list GPUs: NVML cannot count them ({reason(exc)})")
        report = replace(
            unknown,
            gpus=tuple(_gpu(pynvml, i) for i in range(count)),
            driver_version=optional(pynvml, lambda: text(pynvml.nvmlSystemGetDriverVersion())),
            cuda_version=optional(pynvml, lambda: _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion())),
        )
    finally:
        shutdown(pynvml)
    if not report.gpus:
        return replace(report, unavailable="the NVIDIA driver is loaded but lists no GPU")
    return _with_cuda_indexes(report)


def _why_unavailable(pynvml: Any, exc: Exception) -> str:
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
        return "no NVIDIA GPU: the NVIDIA driver is not installed (libnvidia-ml not found); batchfit probes run on CPU"
    if isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
        return "no NVIDIA GPU: the NVIDIA driver is installed but not loaded; batchfit probes run on CPU"
    if isinstance(exc, pynvml.NVMLError_NoPermission):
        return "cannot list GPUs: no permission to talk to the NVIDIA driver"
    return f"cannot list GPUs: NVML failed to start ({reason(exc)})"


def _gpu(pynvml: Any, index: int) -> Gpu:
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError as exc:
        return Gpu(
            index=index,
            name=None,
            uuid=None,
            total_bytes=None,
            used_bytes=None,
            free_bytes=None,
            gpu_utilization=None,
            memory_utilization=None,
            temperature_c=None,
            power_w=None,
            processes=(),
            unreadable=f"NVML cannot open this GPU ({reason(exc)})",
        )
    memory = optional(pynvml, lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    rates = optional(pynvml, lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
    power_mw = optional(pynvml, lambda: pynvml.nvmlDeviceGetPowerUsage(handle))
    mig_enabled = _mig_enabled(pynvml, handle)
    return Gpu(
        index=index,
        name=optional(pynvml, lambda: text(pynvml.nvmlDeviceGetName(handle))),
        uuid=optional(pynvml, lambda: text(pynvml.nvmlDeviceGetUUID(handle))),
        total_bytes=None if memory is None else int(memory.total),
        used_bytes=None if memory is None else int(memory.used),
        free_bytes=None if memory is None else int(memory.free),
        gpu_utilization=None if rates is None else int(rates.gpu),
        memory_utilization=None if rates is None else int(rates.memory),
        temperature_c=optional(
            pynvml, lambda: int(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
        ),
        power_w=None if power_mw is None else power_mw / 1000.0,
        processes=_processes(pynvml, handle),
        mig_enabled=mig_enabled,
        mig_devices=_mig_devices(pynvml, handle) if mig_enabled else (),
    )


def _mig_enabled(pynvml: Any, handle: Any) -> bool | None:
    """The *current* MIG mode (a pending change needs a GPU reset to apply); ``None`` where the GPU
    has no MIG support."""
    modes = optional(pynvml, lambda: pynvml.nvmlDeviceGetMigMode(handle))
    if modes is None:
        return None
    return int(modes[0]) == pynvml.NVML_DEVICE_MIG_ENABLE


def _mig_devices(pynvml: Any, handle: Any) -> tuple[MigDevice, ...]:
    return tuple(_mig_device(pynvml, slot, mig) for slot, mig in mig_handles(pynvml, handle))


def _mig_device(pynvml: Any, slot: int, mig: Any) -> MigDevice:
    if isinstance(mig, pynvml.NVMLError):
        return MigDevice(slot, None, None, None, None, None, unreadable=f"NVML cannot open it ({reason(mig)})")
    memory = optional(pynvml, lambda: pynvml.nvmlDeviceGetMemoryInfo(mig))
    return MigDevice(
        index=slot,
        uuid=optional(pynvml, lambda: text(pynvml.nvmlDeviceGetUUID(mig))),
        name=optional(pynvml, lambda: text(pynvml.nvmlDeviceGetName(mig))),
        total_bytes=None if memory is None else int(memory.total),
        used_bytes=None if memory is None else int(memory.used),
        free_bytes=None if memory is None else int(memory.free),
        gpu_instance_id=optional(pynvml, lambda: int(pynvml.nvmlDeviceGetGpuInstanceId(mig))),
        compute_instance_id=optional(pynvml, lambda: int(pynvml.nvmlDeviceGetComputeInstanceId(mig))),
    )


def _processes(pynvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    found: dict[int, GpuProcess] = {}
    for kind, query in (
        ("compute", pynvml.nvmlDeviceGetComputeRunningProcesses),
        ("graphics", pynvml.nvmlDeviceGetGraphicsRunningProcesses),
    ):
        for proc in optional(pynvml, lambda q=query: q(handle)) or ():  # type: ignore[misc]
            pid = int(proc.pid)
            if pid in found:  # a process can be listed as both; keep the first
                continue
            used = getattr(proc, "usedGpuMemory", None)
            found[pid] = GpuProcess(
                pid=pid, name=_process_name(pynvml, pid), used_bytes=None if used is None else int(used), kind=kind
            )
    return tuple(found.values())


def _process_name(pynvml: Any, pid: int) -> str:
    """NVML's name for ``pid``; inside a container the pid may be the host's, so fall back to
    ``/proc`` and then to ``?``."""
    name = optional(pynvml, lambda: text(pynvml.nvmlSystemGetProcessName(pid)))
    if name:
        return name
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as comm:
            return comm.read().strip() or "?"
    except OSError:
        return "?"


def _with_cuda_indexes(report: DevicesReport) -> DevicesReport:
    """``report`` with each GPU's (and MIG instance's) torch index, matched by UUID. torch's order
    is CUDA's (fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, then ``CUDA_VISIBLE_DEVICES``),
    which need not be NVML's PCI bus order. Unchanged when torch or CUDA cannot answer."""
    indexes = _cuda_indexes()
    if indexes is None:
        return report
    count, by_uuid = indexes
    gpus = tuple(
        replace(
            gpu,
            cuda_index=by_uuid.get(uuid_key(gpu.uuid)),
            mig_devices=tuple(replace(m, cuda_index=by_uuid.get(uuid_key(m.uuid))) for m in gpu.mig_devices),
        )
        for gpu in report.gpus
    )
    return replace(report, gpus=gpus, cuda_device_count=count)


def _cuda_indexes() -> tuple[int, dict[str, int]] | None:
    """How many CUDA devices torch sees and ``{uuid key: torch index}``, or ``None`` when torch is
    missing, has no CUDA, or fails in any way (this is a report: a broken CUDA must not crash it)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        count = torch.cuda.device_count()
        by_uuid: dict[str, int] = {}
        for i in range(count):
            uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
            if uuid is not None:
                by_uuid[uuid_key(str(uuid))] = i
        return count, by_uuid
    except Exception:  # ImportError, RuntimeError from CUDA's init, torch.AcceleratorError, ...
        return None


def _cuda_version(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"
