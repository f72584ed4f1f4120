"""Accelerators with a caching allocator (CUDA, ROCm through the CUDA API, XPU): the meter and limit.

The allocator's own statistics give the peaks: ``reset_peak_memory_stats`` at the start of a
phase, ``max_memory_allocated`` / ``max_memory_reserved`` at its end. They are updated on the host
inside malloc and free, so reading them needs no synchronisation; only timing does (the trial
runner synchronises around the timed steps, nowhere else).

The limit is the per-process memory fraction, which the allocator checks against its *reserved*
segments when it reserves a new one, and only then: a block already in its cache is handed out
without a check. So the cache is emptied before the fraction is applied, and a probe refuses to
start when this process still holds more than the limit (:class:`~batchfit.errors.LimitError`).
The budget therefore counts reserved bytes, and so do the search's aim and the safe batch.

Memory statistics come from ``torch.accelerator.memory`` where the installed torch has it for
this device type, else from the device module (``torch.cuda``, ``torch.xpu``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from batchfit.backends.base import Backend, Meter, requested_bytes
from batchfit.errors import LimitError
from batchfit.report import DeviceInfo
from batchfit.units import format_bytes

#: The collective library of each device type's data (gloo serves only the CPU's).
_PROCESS_GROUP_BACKENDS = {"cuda": "nccl", "xpu": "xccl"}


class AcceleratorBackend(Backend):
    """A device type whose torch module has the caching-allocator API (``torch.cuda``, ``torch.xpu``)."""

    def __init__(self, device_type: str) -> None:
        self.type = device_type

    @property
    def module(self) -> ModuleType:
        """``torch.cuda``, ``torch.xpu``, ...: memory fraction, properties, RNG."""
        return getattr(torch, self.type)

    @property
    def memory(self) -> Any:
        """``torch.accelerator.memory`` when it serves this device type, else the device module."""
        accelerator = getattr(torch, "accelerator", None)
        api = getattr(accelerator, "memory", None)
        current = accelerator.current_accelerator() if api is not None else None
        return api if current is not None and current.type == self.type else self.module

    def validate(self, device: torch.device) -> torch.device:
        if not self.module.is_available():
            raise ValueError(
                f"device {str(device)!r} asked for, but {self.type.upper()} is not available on this machine"
            )
        index = device.index if device.index is not None else self.module.current_device()
        count = self.module.device_count()
        if index >= count:
            raise ValueError(f"device {str(device)!r} does not exist: {count} {self.type} device(s)")
        return torch.device(self.type, index)

    def describe(self, device: torch.device) -> DeviceInfo:
        props = self.module.get_device_properties(device)
        return DeviceInfo(type=self.type, index=device.index, name=props.name, total_bytes=props.total_memory)

    def limit_total_bytes(self, device: torch.device) -> int | None:
        # The fraction the allocator applies is of the device's total as the runtime reports it.
        return int(self.module.get_device_properties(device).total_memory)

    def reachable_bytes(self, device: torch.device) -> int | None:
        """Free memory plus what this process's allocator holds, and never more than a lower
        per-process fraction the user set allows."""
        free, _ = self.module.mem_get_info(device)
        reachable = int(free) + int(self.memory.memory_reserved(device))
        fraction = self.get_fraction(device)
        if fraction is not None and fraction < 1.0:
            reachable = min(reachable, int(fraction * self.limit_total_bytes(device)))
        return reachable

    def outside_allocator_bytes(self, device: torch.device) -> int:
        free, total = self.module.mem_get_info(device)
        return max(0, int(total) - int(free) - int(self.memory.memory_reserved(device)))

    def make_meter(
        self, device: torch.device, budget_bytes: int | None, limit_bytes: int | None, tensors: list[torch.Tensor]
    ) -> Meter:
        return AllocatorMeter(self, device, budget_bytes, limit_bytes)

    def empty_cache(self, device: torch.device) -> None:
        self.memory.empty_cache()

    def synchronize(self, device: torch.device) -> None:
        self.module.synchronize(device)

    def get_rng_state(self, device: torch.device) -> Any:
        # Every device of this type: a probe on one device must not disturb the others either.
        if not self.module.is_initialized():
            return None
        return self.module.get_rng_state_all()

    @property
    def process_group_backend(self) -> str:  # type: ignore[override]
        return _PROCESS_GROUP_BACKENDS.get(self.type, "gloo")

    def bind(self, device: torch.device) -> None:
        self.module.set_device(device)

    def ddp_device_ids(self, device: torch.device) -> list[int] | None:
        return [device.index] if device.index is not None else None

    def set_rng_state(self, device: torch.device, state: Any) -> None:
        if state is not None:
            self.module.set_rng_state_all(state)

    # the memory fraction ----------------------------------------------------------------------
    def get_fraction(self, device: torch.device) -> float | None:
        """The fraction in force, or ``None`` where this torch cannot say (older than 2.6)."""
        getter = getattr(self.module, "get_per_process_memory_fraction", None)
        return None if getter is None else float(getter(device))

    def set_fraction(self, fraction: float, device: torch.device) -> None:
        self.module.set_per_process_memory_fraction(fraction, device)


class AllocatorMeter(Meter):
    """Caching-allocator statistics, and a limit through the per-process memory fraction."""

    counts = "reserved"

    def __init__(
        self, backend: AcceleratorBackend, device: torch.device, budget_bytes: int | None, limit_bytes: int | None
    ) -> None:
        super().__init__()
        self.backend = backend
        self.device = device
        self.total_bytes = backend.limit_total_bytes(device)
        self.budget_bytes = budget_bytes
        self._limit = limit_bytes

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        backend, device, limit = self.backend, self.device, self._limit
        # Start from an empty cache, limit or not: blocks cached before the probe would be
        # handed to the first trial unchecked by a cap, and would inflate its reserved peak.
        gc.collect()
        backend.empty_cache(device)
        if limit is None:
            yield
            return
        reserved = self.reserved_bytes()
        if reserved > limit:
            raise LimitError(
                f"this process already holds {format_bytes(reserved)} on {device} "
                f"({format_bytes(self.allocated_bytes())} in live tensors) after emptying the cache, more than "
                f"the memory limit of {format_bytes(limit)}: the limit could not be enforced. Free those "
                "tensors (or probe in a fresh process), or raise memory_limit."
            )
        previous = backend.get_fraction(device)
        ours = min(1.0, limit / self.total_bytes) if self.total_bytes else 1.0
        # Never raise a lower fraction the user set; without a getter assume none was set.
        backend.set_fraction(ours if previous is None else min(previous, ours), device)
        try:
            yield
        finally:
            backend.set_fraction(1.0 if previous is None else previous, device)

    def allocated_bytes(self) -> int:
        return int(self.backend.memory.memory_allocated(self.device))

    def reserved_bytes(self) -> int:
        return int(self.backend.memory.memory_reserved(self.device))

    def _storage_bytes(self, storage: torch.UntypedStorage) -> int:
        # The caching allocator hands out blocks in multiples of 512 bytes (kMinBlockSize).
        return -(-storage.nbytes() // 512) * 512

    def begin_trial(self) -> None:
        super().begin_trial()
        self.backend.memory.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        # Host-side statistics: no synchronisation needed to read them (see the module docs).
        memory = self.backend.memory
        memory.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            allocated = int(memory.max_memory_allocated(self.device))
            reserved = int(memory.max_memory_reserved(self.device))
            self._phase_peaks[name] = max(self._phase_peaks.get(name, 0), allocated)
            self._phase_reserved[name] = max(self._phase_reserved.get(name, 0), reserved)

    def failure_bytes(self, message: str) -> tuple[int | None, int | None]:
        """``(allocated, reserved)`` lower bounds of a failed step's need.

        The size in a CUDA OOM message is the segment the allocator tried to reserve after
        rounding (2 MiB and 20 MiB segments, 2 MiB multiples), so it bounds the *reserved* need
        (reserved now plus that segment, which the cap refused), not the allocated one: what
        live tensors held when the step failed is the allocated bound.
        """
        segment = requested_bytes(message)
        reserved = None if segment is None else self.reserved_bytes() + segment
        return self.allocated_bytes(), reserved

    def synchronize(self) -> None:
        self.backend.synchronize(self.device)

    def release(self, target_bytes: int | None = None) -> None:
        super().release(target_bytes)
        self.backend.empty_cache(self.device)
        self.backend.memory.reset_peak_memory_stats(self.device)
