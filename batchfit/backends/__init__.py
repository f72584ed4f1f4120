"""Every device specific, behind one small interface (:class:`Backend`, :class:`Meter`).

Nothing outside this package branches on the device type: the probe asks :func:`backend_for`
for the backend of its device and talks to it. Adding a device kind is adding a module here and a
line in :func:`backend_for` (:mod:`batchfit.backends.select`).

* ``base``: the seam itself, :class:`Backend` and :class:`Meter`;
* ``cpu``: the live-tensor meter and its limit (:class:`LiveTensorMeter`);
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
    from batchfit.backends.alloc_conf import AllocatorConfig
    from batchfit.backends.allocator_model import CachingAllocatorModel
    from batchfit.backends.allocator_snapshot import block_bytes_by_address
    from batchfit.backends.base import Backend, Meter, requested_bytes
    from batchfit.backends.cpu import LiveTensorMeter, available_host_bytes
    from batchfit.backends.gpus import DevicesReport, Gpu, GpuProcess, MigDevice, query_devices
    from batchfit.backends.nvml import NvmlIdentity, nvml_device_by_uuid
    from batchfit.backends.oom import is_device_failure, is_oom, is_sticky_device_error
    from batchfit.backends.select import SUPPORTED, backend_for, default_device, model_device, resolve_device
    from batchfit.backends.simulated import (
        DEFAULT_ESTIMATE_TARGET,
        ESTIMATE_TARGETS,
        EstimateTarget,
        SimulatedCudaMeter,
        estimate_target,
    )

_EXPORTS = {
    "Backend": "batchfit.backends.base",
    "Meter": "batchfit.backends.base",
    "requested_bytes": "batchfit.backends.base",
    "LiveTensorMeter": "batchfit.backends.cpu",
    "available_host_bytes": "batchfit.backends.cpu",
    "SUPPORTED": "batchfit.backends.select",
    "backend_for": "batchfit.backends.select",
    "default_device": "batchfit.backends.select",
    "model_device": "batchfit.backends.select",
    "resolve_device": "batchfit.backends.select",
    "is_oom": "batchfit.backends.oom",
    "is_sticky_device_error": "batchfit.backends.oom",
    "is_device_failure": "batchfit.backends.oom",
    "DevicesReport": "batchfit.backends.gpus",
    "Gpu": "batchfit.backends.gpus",
    "GpuProcess": "batchfit.backends.gpus",
    "MigDevice": "batchfit.backends.gpus",
    "query_devices": "batchfit.backends.gpus",
    "NvmlIdentity": "batchfit.backends.nvml",
    "nvml_device_by_uuid": "batchfit.backends.nvml",
    "AllocatorConfig": "batchfit.backends.alloc_conf",
    "CachingAllocatorModel": "batchfit.backends.allocator_model",
    "block_bytes_by_address": "batchfit.backends.allocator_snapshot",
    "DEFAULT_ESTIMATE_TARGET": "batchfit.backends.simulated",
    "ESTIMATE_TARGETS": "batchfit.backends.simulated",
    "EstimateTarget": "batchfit.backends.simulated",
    "SimulatedCudaMeter": "batchfit.backends.simulated",
    "estimate_target": "batchfit.backends.simulated",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_surface(__name__, globals(), _EXPORTS)
