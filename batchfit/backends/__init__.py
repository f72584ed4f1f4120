"""Every device specific, behind one small interface (`Backend`, `Meter`).

Nothing outside this package branches on the device type: the probe asks `backend_for`
for the backend of its device and talks to it. Adding a device kind is adding a module here and a
line in `backend_for` (`batchfit.backends.select`).

* ``base``: the seam itself, `Backend` and `Meter`;
* ``cpu``: the live-tensor meter and its limit (`LiveTensorMeter`);
* ``accelerator``: the caching-allocator meter and limit (CUDA, ROCm, XPU);
* ``cuda``: what is CUDA's own (NVML names, the allocator configuration, cuBLAS warm-up);
* ``oom``: is this exception an out-of-memory, and did it poison the device;
* ``nvml`` and ``gpus``: what NVML says about a device, and the report of ``batchfit devices``;
* ``allocator_model`` and ``simulated``: a model of CUDA's caching allocator, and the meter that
  counts a fake-tensor trace with it (``batchfit.estimate``'s CUDA target); ``allocator_blocks``
  the model's memory, ``allocator_snapshot`` the ``torch.cuda.memory_snapshot()`` format, and
  ``alloc_conf`` the allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``), for the model and the probe.

The names below are imported on first use: ``batchfit devices`` reaches NVML through this package
and must not import torch (``batchfit._lazy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_surface

if TYPE_CHECKING:
    from batchfit.backends.base import Backend, Meter
    from batchfit.backends.cpu import LiveTensorMeter
    from batchfit.backends.gpus import DevicesReport, Gpu, MigDevice, query_devices
    from batchfit.backends.oom import is_device_failure, is_oom, is_sticky_device_error
    from batchfit.backends.select import backend_for, default_device, resolve_device
    from batchfit.backends.simulated import DEFAULT_ESTIMATE_TARGET, ESTIMATE_TARGETS, EstimateTarget, estimate_target

_EXPORTS = {
    "Backend": "batchfit.backends.base",
    "Meter": "batchfit.backends.base",
    "LiveTensorMeter": "batchfit.backends.cpu",
    "DevicesReport": "batchfit.backends.gpus",
    "Gpu": "batchfit.backends.gpus",
    "MigDevice": "batchfit.backends.gpus",
    "query_devices": "batchfit.backends.gpus",
    "is_device_failure": "batchfit.backends.oom",
    "is_oom": "batchfit.backends.oom",
    "is_sticky_device_error": "batchfit.backends.oom",
    "backend_for": "batchfit.backends.select",
    "default_device": "batchfit.backends.select",
    "resolve_device": "batchfit.backends.select",
    "DEFAULT_ESTIMATE_TARGET": "batchfit.backends.simulated",
    "ESTIMATE_TARGETS": "batchfit.backends.simulated",
    "EstimateTarget": "batchfit.backends.simulated",
    "estimate_target": "batchfit.backends.simulated",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_surface(__name__, globals(), _EXPORTS)
