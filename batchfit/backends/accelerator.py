"""Accelerators with a caching allocator (CUDA, ROCm through the CUDA API, XPU): the meter and limit.

The allocator's own statistics give the peaks: ``reset_peak_memory_stats`` at the start of a
phase, ``max_memory_allocated`` / ``max_memory_reserved`` at its end. They are updated on the host
inside malloc and free, so reading them needs no synchronisation; only timing does (the trial
runner synchronises around the timed steps, nowhere else).

The limit is the per-process memory fraction, which the allocator checks against its *reserved*
segments when it reserves a new one, and only then: a block already in its cache is handed out
without a check. So the cache is emptied before the fraction is applied, and a probe refuses to
start when this process still holds more than the limit ([`LimitError`][batchfit.LimitError]).
Under expandable segments the check is of the whole segment a request would need, though only the
pages missing are mapped: stricter than a device of the limit's size, which the result's notes say.
The budget therefore counts reserved bytes, and so do the search's aim and the safe batch.

Memory statistics come from ``torch.accelerator.memory`` where the installed torch has it for
this device type, else from the device module (``torch.cuda``, ``torch.xpu``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

import torch

from batchfit.backends.alloc_conf import AllocatorConfig
from batchfit.backends.allocator_rule import SEGMENTS, AllocatorWatch, rule_of, unmodelled
from batchfit.backends.allocator_snapshot import block_bytes_by_address
from batchfit.backends.base import Backend, Meter, data_storages, requested_bytes
from batchfit.errors import LimitError
from batchfit.report import DeviceInfo
from batchfit.report.records import AllocatorFacts
from batchfit.units import format_bytes

#: The collective library of each device type's data (gloo serves only the CPU's).
_PROCESS_GROUP_BACKENDS = {"cuda": "nccl", "xpu": "xccl"}


class AcceleratorBackend(Backend):
    """A device type whose torch module has the caching-allocator API (``torch.cuda``, ``torch.xpu``)."""

    cold_after_release = True

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

    def memory_snapshot(self) -> list[Any]:
        """The allocator's segments and blocks (``torch.cuda.memory_snapshot()``'s format)."""
        return list(self.module.memory_snapshot())

    def memory_stats(self, device: torch.device) -> dict[str, Any]:
        """The allocator's counters (``torch.cuda.memory_stats()``): retries, split-free bytes, segments.
        Empty where this allocator backend keeps none."""
        try:
            return dict(self.module.memory_stats(device))
        except Exception:  # noqa: BLE001 (an allocator backend without statistics)
            return {}

    @contextlib.contextmanager
    def recorded_requests(self, device: torch.device) -> Iterator[Callable[[], int | None]]:
        """The code inside with its allocations recorded; yields a call that reads the largest one so far
        (``None``: not recorded here). Only CUDA records them (`CudaBackend`)."""
        yield _unrecorded

    def allocator_settings(self) -> AllocatorConfig:
        """The caching allocator's configuration (``PYTORCH_ALLOC_CONF``): the defaults here."""
        return AllocatorConfig()

    # the memory fraction ----------------------------------------------------------------------
    def get_fraction(self, device: torch.device) -> float | None:
        """The fraction in force, or ``None`` where none is set or this torch cannot say (older than 2.6).

        A fraction above 1.0 means none is set: under ``backend:cudaMallocAsync`` torch reports the
        unset limit (the largest size) over the device's memory, about 2e8 (pytorch#110194), a value
        its own ``set_per_process_memory_fraction`` refuses, so it must never be written back.
        """
        getter = getattr(self.module, "get_per_process_memory_fraction", None)
        if getter is None:
            return None
        fraction = float(getter(device))
        return fraction if fraction <= 1.0 else None

    def set_fraction(self, fraction: float, device: torch.device) -> None:
        self.module.set_per_process_memory_fraction(fraction, device)


class AllocatorMeter(Meter):
    """Caching-allocator statistics, and a limit through the per-process memory fraction."""

    counts = "reserved"
    layout_carries = True

    def __init__(
        self, backend: AcceleratorBackend, device: torch.device, budget_bytes: int | None, limit_bytes: int | None
    ) -> None:
        super().__init__()
        self.backend = backend
        self.device = device
        self.total_bytes = backend.limit_total_bytes(device)
        self.budget_bytes = budget_bytes
        self._limit = limit_bytes
        #: The cap in force (the limit, or a lower one from `capped`), ``None`` without one.
        self._cap: int | None = None
        #: ``backend:cudaMallocAsync`` caps the bytes requested, not the pool it reserves (see `phase`).
        settings = backend.allocator_settings()
        self._caps_requested = settings.backend == "cudaMallocAsync"
        #: Expandable segments: a cap checks whole segments, a device only the pages mapped (`_note_cap`).
        self._expandable = settings.expandable_segments and not self._caps_requested
        self._notes: list[str] = []
        #: The trial's allocator facts and the rule that judges them (``batchfit.backends.allocator_rule``).
        self.watch = AllocatorWatch(rule_of(settings.backend, settings.expandable_segments))
        self._notes += unmodelled(settings)
        self._largest_request: Callable[[], int | None] = _unrecorded
        #: Inside `fresh_process`: the workspaces a trial makes again are freed before its leak is measured.
        self._replaying = False

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
                f"({format_bytes(self.allocated_bytes())} in live tensors), more than the memory limit of "
                f"{format_bytes(limit)}: free those tensors, probe in a fresh process or raise memory_limit "
                "(see docs/concepts/measuring.md#cuda)"
            )
        previous = backend.get_fraction(device)
        ours = min(1.0, limit / self.total_bytes) if self.total_bytes else 1.0
        if (previous is None or previous >= 1.0) and backend.allocator_settings().garbage_collection_threshold:
            # torch has no call that switches a fraction off again: restoring 1.0 leaves it on,
            # and with it the garbage_collection_threshold that only acts under a fraction.
            self._notes.append(
                "the allocator's garbage_collection_threshold stays active in this process after the probe "
                "(see docs/concepts/measuring.md#allocator-settings)"
            )
        # Never raise a lower fraction the user set; with none set (or no getter) 1.0 is restored.
        backend.set_fraction(ours if previous is None else min(previous, ours), device)
        self._cap = limit
        self._note_cap()
        try:
            yield
        finally:
            self._cap = None
            backend.set_fraction(1.0 if previous is None else previous, device)

    @contextlib.contextmanager
    def capped(self, cap_bytes: int | None) -> Iterator[None]:
        """Lower the allocator's cap to ``cap_bytes`` for the code inside (see `Meter.capped`).

        The cache is emptied first: a cached block is handed out without a check against the cap.
        """
        current = self._cap if self._cap is not None else self.budget_bytes
        if cap_bytes is None or (current is not None and cap_bytes >= current) or not self.total_bytes:
            yield
            return
        backend, device = self.backend, self.device
        gc.collect()
        backend.empty_cache(device)
        previous = backend.get_fraction(device)
        lowered = min(1.0, cap_bytes / self.total_bytes)
        backend.set_fraction(lowered if previous is None else min(previous, lowered), device)
        cap, budget = self._cap, self.budget_bytes
        self._cap, self.budget_bytes = cap_bytes, cap_bytes
        self._note_cap()
        try:
            yield
        finally:
            self._cap, self.budget_bytes = cap, budget
            backend.set_fraction(1.0 if previous is None else previous, device)

    def allocated_bytes(self) -> int:
        return int(self.backend.memory.memory_allocated(self.device))

    def reserved_bytes(self) -> int:
        return int(self.backend.memory.memory_reserved(self.device))

    def held_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """What ``tensors`` hold in the allocator's *blocks*: the large pool does not split off a
        remainder of 1 MiB or less, which then counts in ``memory_allocated`` too, so 512-byte
        rounding would leave it as a false leak (read from the allocator's snapshot)."""
        storages = {s._cdata: s for t in tensors for s in data_storages(t)}
        if not storages:
            return 0
        try:
            blocks = block_bytes_by_address(self.backend.memory_snapshot())
        except Exception:  # noqa: BLE001 (cudaMallocAsync keeps no snapshot: 512-byte rounding)
            blocks = {}
        return sum(blocks.get(s.data_ptr(), self._storage_bytes(s)) for s in storages.values())

    def _storage_bytes(self, storage: torch.UntypedStorage) -> int:
        # The caching allocator hands out blocks in multiples of 512 bytes (kMinBlockSize).
        return -(-storage.nbytes() // 512) * 512

    def begin_trial(self) -> None:
        super().begin_trial()
        self.backend.memory.reset_peak_memory_stats(self.device)
        self.watch.begin(self.backend.memory_stats(self.device))

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """The trial's requests recorded, for the largest one (`AcceleratorBackend.recorded_requests`)."""
        with self.backend.recorded_requests(self.device) as largest:
            self._largest_request = largest
            try:
                yield
            finally:
                self._largest_request = _unrecorded

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
            self.watch.phase_ended(name, self.backend.memory_stats(self.device), allocated, reserved)

    def trial_facts(self) -> AllocatorFacts | None:
        try:
            segments: list[Any] | None = self.backend.memory_snapshot()
        except Exception:  # noqa: BLE001 (cudaMallocAsync keeps no snapshot)
            segments = None
        return self.watch.facts(self._largest_request(), segments)

    def refusal(self) -> tuple[str, str] | None:
        return self.watch.refusal()

    def layout(self) -> tuple[int, ...]:
        return (self.reserved_bytes(), int(self.backend.memory_stats(self.device).get(SEGMENTS, 0) or 0))

    @contextlib.contextmanager
    def fresh_process(self) -> Iterator[None]:
        """Nothing cached, no cuBLAS workspace: the trial inside makes them in its own steps, as a fresh
        training process does (its first backward carves autograd's workspace out of its cached blocks).
        `release` frees them again before the trial's leak is measured; the prober warms up afterwards."""
        self.backend.clear_workspaces(self.device)
        self.backend.empty_cache(self.device)
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    def failure_bytes(self, message: str) -> tuple[int | None, int | None]:
        """``(allocated, reserved)`` lower bounds of a failed step's need.

        The size in a CUDA OOM message is the segment the allocator tried to reserve after
        rounding (2 MiB and 20 MiB segments, 2 MiB multiples), so it bounds the *reserved* need
        (reserved now plus that segment, which the cap refused), not the allocated one: what
        live tensors held when the step failed is the allocated bound.
        """
        requested = requested_bytes(message)
        self.watch.failed(requested)
        if self._caps_requested:  # its size is checked against the bytes in use, not the pool
            return self.allocated_bytes() + (requested or 0), None
        segment = requested
        reserved = None if segment is None else self.reserved_bytes() + segment
        return self.allocated_bytes(), reserved

    def notes(self) -> list[str]:
        return list(self._notes)

    def _note_cap(self) -> None:
        """Say what a cap changes under these allocator settings, once one is in force. Kept in the
        notes, not read from the cap: a result's notes are read after the probe, when the cap is gone.

        Under ``backend:cudaMallocAsync`` the fraction caps requested bytes (`phase` fails a
        step whose pool is over). Under expandable segments torch checks the whole segment a request
        would reserve without them against the fraction, before it maps only the pages missing beyond
        the free block at the segment's end (``allocator_model.segment_size``): a capped step within a
        page of the limit can fail that a device of the limit's size would run, a conservative answer.
        """
        notes: list[str] = []
        if self._expandable:
            notes.append(
                "the allocator has expandable segments, under which the cap can fail a step within a page of the "
                "limit that a device of that size would run: the answer is on the safe side "
                "(see docs/concepts/measuring.md#allocator-settings)"
            )
        if self._caps_requested:
            notes.append(
                "the allocator is backend:cudaMallocAsync, whose memory fraction caps requested bytes (the same "
                "in every process): a step fits when no request was refused; the driver's pool reserves more, "
                "which the safe batch keeps room for (see docs/concepts/measuring.md#what-fits-on-cuda)"
            )
        self._notes.extend(note for note in notes if note not in self._notes)

    def synchronize(self) -> None:
        self.backend.synchronize(self.device)

    def release(self, target_bytes: int | None = None) -> None:
        if self._replaying:  # the workspaces the replayed steps made: warm_up makes them again afterwards
            self.backend.clear_workspaces(self.device)
        super().release(target_bytes)
        if not self.keeps_cache:
            self.backend.empty_cache(self.device)
        self.backend.memory.reset_peak_memory_stats(self.device)


def _unrecorded() -> int | None:
    """The largest request where none was recorded."""
    return None
