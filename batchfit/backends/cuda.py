"""The CUDA backend (NVIDIA, and AMD through ROCm's CUDA API): the allocator meter plus what is
CUDA's own: NVML names, the allocator configuration, and the one-time cuBLAS workspaces.

cuBLAS and cuBLASLt take a workspace from the caching allocator on the first matmul of each
thread and stream (32 MiB per handle on sm90, about 8 MiB elsewhere; autograd's backward runs
on a thread of its own) and keep it for the life of the process. Counted inside the first
trial they would look like a leak, and they would shift that trial's peak; `warm_up`
makes them before anything is measured. Training pays them too, so they stay in the budget. A
fresh training process makes them inside its first steps, out of its own cached blocks: a replay of
one (`Meter.fresh_process`) frees them first (`clear_workspaces`), and `warm_up` puts them back.

The largest single allocation of a trial is read from the allocator's own history
(``torch.cuda.memory._record_memory_history`` without stack traces, while the trial runs), never from
a process that already records one: the user's recording is left as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator

import torch

from batchfit.backends.accelerator import AcceleratorBackend
from batchfit.backends.alloc_conf import AllocatorConfig
from batchfit.report import DeviceInfo


class CudaBackend(AcceleratorBackend):
    """CUDA devices: the allocator meter, described through NVML, warmed up before measuring."""

    def __init__(self) -> None:
        super().__init__("cuda")

    def describe(self, device: torch.device) -> DeviceInfo:
        from batchfit.backends.nvml import nvml_device_by_uuid  # lazy: NVML only when a CUDA device is described

        props = torch.cuda.get_device_properties(device)
        identity = nvml_device_by_uuid(str(getattr(props, "uuid", "") or ""))
        return DeviceInfo(
            type="cuda",
            index=device.index,
            name=identity.name if identity is not None else props.name,
            total_bytes=int(props.total_memory),
            nvml_total_bytes=None if identity is None else identity.total_bytes,
            config=cuda_config(),
        )

    def allocator_settings(self) -> AllocatorConfig:
        """What ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` set, with the backend torch reports
        (the environment is read once, when CUDA initialises: torch's answer wins)."""
        settings = AllocatorConfig.from_environ(os.environ)
        backend = getattr(torch.cuda, "get_allocator_backend", None)
        if backend is not None and torch.cuda.is_initialized() and backend() != settings.backend:
            name = backend()  # "pluggable" after change_current_allocator: no setting applies to it
            known = name if name in ("native", "cudaMallocAsync") else "pluggable"
            settings = dataclasses.replace(settings, backend=known)
        return settings

    def warm_up(self, device: torch.device, amp_dtype: torch.dtype | None) -> None:
        with torch.cuda.device(device):
            weight = torch.ones(16, 16, device=device, requires_grad=True)
            bias = torch.zeros(16, device=device, requires_grad=True)
            inputs = torch.ones(16, 16, device=device, requires_grad=True)
            for dtype in dict.fromkeys((None, amp_dtype)):
                # linear() with a bias goes through cuBLASLt, a plain matmul through cuBLAS;
                # backward() runs both on autograd's own thread, which has handles of its own.
                with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
                    out = torch.nn.functional.linear(inputs, weight, bias) @ weight
                out.float().sum().backward()
            del weight, bias, inputs, out
            torch.cuda.synchronize(device)

    def clear_workspaces(self, device: torch.device) -> None:
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            torch.cuda.synchronize(device)
            clear()

    @contextlib.contextmanager
    def recorded_requests(self, device: torch.device) -> Iterator[Callable[[], int | None]]:
        memory = torch.cuda.memory
        record = getattr(memory, "_record_memory_history", None)
        enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
        if record is None or enabled is None or enabled():
            yield lambda: None  # the user records a history of their own: never touch it
            return
        try:  # this trial's events only: an earlier trial's stay out of its largest request
            record(enabled="all", context=None, stacks="python", max_entries=_HISTORY_EVENTS, clear_history=True)
        except Exception:  # noqa: BLE001 (a torch whose signature differs: not recorded)
            yield lambda: None
            return

        def largest() -> int | None:
            try:
                traces = memory._snapshot(device).get("device_traces", [])
            except Exception:  # noqa: BLE001
                return None
            index = device.index if device.index is not None else torch.cuda.current_device()
            events = traces[index] if index < len(traces) else []
            return max((int(event["size"]) for event in events if event.get("action") == "alloc"), default=None)

        try:
            yield largest
        finally:
            with contextlib.suppress(Exception):
                record(enabled=None)


#: The allocation events a trial's history keeps (a ring buffer): a few steps of a large model.
_HISTORY_EVENTS = 200_000


def cuda_config() -> tuple[tuple[str, str], ...]:
    """The settings that change what a step allocates or how fast it runs, for the record."""
    config: list[tuple[str, str]] = []
    backend = getattr(torch.cuda, "get_allocator_backend", None)
    config.append(("allocator", backend() if backend is not None else "native"))
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if os.environ.get(name):
            config.append((name, os.environ[name]))
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    config.append(("matmul fp32", str(precision) if precision is not None else f"allow_tf32={matmul.allow_tf32}"))
    cudnn = torch.backends.cudnn
    cudnn_precision = getattr(cudnn, "fp32_precision", None)
    config.append(
        ("cudnn fp32", str(cudnn_precision) if cudnn_precision is not None else f"allow_tf32={cudnn.allow_tf32}")
    )
    config.append(("cudnn.benchmark", str(bool(cudnn.benchmark))))
    config.append(("cuda runtime", str(torch.version.cuda or torch.version.hip or "?")))
    return tuple(config)
