"""The CUDA backend (NVIDIA, and AMD through ROCm's CUDA API): the allocator meter plus what is
CUDA's own: NVML names, the allocator configuration, and the one-time cuBLAS workspaces.

cuBLAS and cuBLASLt take a workspace from the caching allocator on the first matmul of each
thread and stream (32 MiB per handle on sm90, about 8 MiB elsewhere; autograd's backward runs
on a thread of its own) and keep it for the life of the process. Counted inside the first
trial they would look like a leak, and they would shift that trial's peak; `warm_up`
makes them before anything is measured. Training pays them too, so they stay in the budget.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from batchfit.backends.accelerator import AcceleratorBackend
from batchfit.backends.alloc_conf import AllocatorConfig
from batchfit.report import DeviceInfo


class CudaBackend(AcceleratorBackend):
    """CUDA devices: the allocator meter, described through NVML, warmed up before measuring."""

    def __init__(self) -> None:
        super().__init__("cuda")

    def describe(self, device: torch.device) -> DeviceInfo:
        from batchfit.backends.nvml import nvml_device_by_uuid

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
            settings = dataclasses.replace(settings, backend=backend())
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
