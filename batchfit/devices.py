"""Which device a probe runs on, and what that device is (name, total memory).

NVIDIA names and totals come from NVML (``nvidia-ml-py``) when it is available, matched to
torch's device by UUID so that ``CUDA_VISIBLE_DEVICES`` reordering cannot mix GPUs up; torch's
own properties are the fallback.
"""

from __future__ import annotations

import platform

import torch
from torch import nn

from batchfit.memory import total_host_bytes
from batchfit.result import DeviceInfo


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
    """The device to probe on: ``requested``, else where the model is. Validated."""
    if requested is None:
        device = model_device(model)
    else:
        if not isinstance(requested, (str, torch.device)):
            raise TypeError(f"device must be a string or torch.device, not {type(requested).__name__}")
        try:
            device = torch.device(requested)
        except RuntimeError as exc:
            raise ValueError(f"device {requested!r} is not a device torch knows: {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} asked for, but CUDA is not available on this machine")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"batchfit measures memory on 'cpu' and 'cuda' devices; {device.type!r} is not supported yet")
    return device


def describe(device: torch.device) -> DeviceInfo:
    """Name and total memory of ``device``."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, total = _nvml_name_and_total(props) or (props.name, props.total_memory)
        return DeviceInfo(type="cuda", index=device.index, name=name, total_bytes=total)
    return DeviceInfo(type="cpu", index=None, name=_cpu_name(), total_bytes=total_host_bytes())


def _nvml_name_and_total(props: object) -> tuple[str, int] | None:
    try:
        import pynvml
    except ImportError:
        return None
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        name = pynvml.nvmlDeviceGetName(handle)
        total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        return (name.decode() if isinstance(name, bytes) else name), int(total)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return "CPU: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU: " + (platform.processor() or platform.machine())
