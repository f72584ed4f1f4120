"""Which backend serves a device, and which device a probe runs on."""

from __future__ import annotations

import torch
from torch import nn

from batchfit.backends.accelerator import AcceleratorBackend
from batchfit.backends.base import Backend
from batchfit.backends.cpu import CpuBackend
from batchfit.backends.cuda import CudaBackend

SUPPORTED = ("cpu", "cuda", "xpu")

#: The device type of the host processor, whose memory batchfit meters itself (no card's allocator).
HOST = "cpu"


def is_host(device: str | torch.device) -> bool:
    """Whether ``device`` (``"cpu"``, ``"cpu:0"``, a ``torch.device``) is the host processor: the one
    place outside the backends' own modules that asks, so no other module compares with ``"cpu"``."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]
    return kind == HOST


def backend_for(device: torch.device) -> Backend:
    """The backend that serves ``device.type``."""
    if device.type == "cpu":
        return CpuBackend()
    if device.type == "cuda":
        return CudaBackend()
    if device.type == "xpu":
        return AcceleratorBackend("xpu")
    raise ValueError(
        f"batchfit measures memory on {', '.join(repr(s) for s in SUPPORTED)} devices; "
        f"{device.type!r} is not supported yet"
    )


def default_device() -> str:
    """Where a probe runs when nobody said: the accelerator torch sees, else the CPU."""
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    if current is not None and current.type in SUPPORTED:
        return current.type
    return "cpu"


def model_device(model: nn.Module) -> torch.device:
    """The single device the model's parameters and buffers live on (CPU for an empty model)."""
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if not devices:
        return torch.device("cpu")
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"the model spans several devices ({names}); batchfit probes one device: "
            "move the model to one device or pass device="
        )
    return devices.pop()


def resolve_device(requested: str | torch.device | None, model: nn.Module) -> torch.device:
    """The device to probe on: ``requested``, else where the model is; validated by its backend."""
    if requested is None:
        device = model_device(model)
    else:
        if not isinstance(requested, (str, torch.device)):
            raise TypeError(f"device must be a string or torch.device, not {type(requested).__name__}")
        try:
            device = torch.device(requested)
        except RuntimeError as exc:
            raise ValueError(f"device {requested!r} is not a device torch knows: {exc}") from None
    return backend_for(device).validate(device)
