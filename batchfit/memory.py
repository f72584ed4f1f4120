"""Memory meters: peak memory of a trial, per phase, and a memory limit, per device.

One small interface, two implementations:

* :class:`CudaMeter` reads the CUDA caching allocator's own statistics
  (``reset_peak_memory_stats`` / ``max_memory_allocated``) and applies a limit with
  ``torch.cuda.set_per_process_memory_fraction``, so the real allocator raises
  ``torch.OutOfMemoryError`` at the cap. The previous fraction is restored afterwards.
* :class:`LiveTensorMeter` is for the CPU, which has no allocator statistics. A
  ``TorchDispatchMode`` sees every operation; each output whose storage is new (not one of the
  op's inputs' storages, not already counted) adds ``storage.nbytes()`` to the live total, and a
  ``weakref.finalize`` on the storage subtracts it when the storage dies. That is the exact
  live-tensor peak of a step, gradients and optimizer state included. With a limit, the
  operation whose output takes live memory over the cap raises a real
  ``torch.OutOfMemoryError``, in forward, backward or optimizer step, as a GPU of that size
  would. Its message carries the CPU allocator's wording ("DefaultCPUAllocator: can't allocate
  memory") so other libraries' OOM detection recognises it too.

  What it does not see: scratch memory that a kernel allocates and frees inside itself (CPU
  convolutions do this), and allocator overheads. The CPU limit is therefore a limit on live
  *tensor* bytes: well defined and repeatable, not the process's resident size.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from batchfit.units import format_bytes

#: Without an explicit limit, a CPU probe may use this fraction of the memory that is
#: available when it starts. The live-tensor meter does not see kernel scratch memory or
#: allocator overheads, so half leaves room for them and for the rest of the machine.
DEFAULT_CPU_FRACTION = 0.5


class Meter:
    """The interface the trial runner uses; one instance per probe and device."""

    device: torch.device
    budget_bytes: int | None
    total_bytes: int | None

    def __init__(self) -> None:
        self._phase_peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Apply the limit for the lifetime of a probe and undo it afterwards."""
        yield

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Measure the code inside (a trial's steps)."""
        yield

    def allocated_bytes(self) -> int:
        """Memory live on the device now, as this meter counts it."""
        raise NotImplementedError

    def begin_trial(self) -> None:
        self._phase_peaks = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the peak of the code inside under ``name``."""
        raise NotImplementedError
        yield  # pragma: no cover

    def phase_peaks(self) -> dict[str, int]:
        return dict(self._phase_peaks)

    def failure_bytes(self, message: str) -> int | None:
        """Memory live plus the failing request, read inside the ``except`` of an OOM.

        Read while the failed step's tensors are still referenced, so "live" is what the
        step had when the allocator said no; ``None`` when the message states no size.
        """
        requested = requested_bytes(message)
        return None if requested is None else self.allocated_bytes() + requested

    def synchronize(self) -> None:
        """Wait for queued device work (so wall-clock timing is honest)."""

    def release(self, target_bytes: int | None = None) -> None:
        """Give back what the last trial left behind.

        A full ``gc.collect()`` costs tens to hundreds of milliseconds once torch is loaded,
        more than a small model's whole step, so it only runs when memory is still above
        ``target_bytes`` (the pre-trial level), i.e. when reference cycles really hold tensors.
        """
        if target_bytes is None or self.allocated_bytes() > target_bytes:
            gc.collect()


class LiveTensorMeter(Meter):
    """Exact live-tensor accounting on the CPU, with an optional limit (see module docs)."""

    def __init__(self, budget_bytes: int | None, total_bytes: int | None, baseline_bytes: int) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self.budget_bytes = budget_bytes
        self.total_bytes = total_bytes
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}
        self._baseline = baseline_bytes
        self._current = baseline_bytes
        self._peak = baseline_bytes
        self._phase: str | None = None
        self._last_failure: int | None = None

    # accounting --------------------------------------------------------------------------
    def _add(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._live[key] = nbytes
            self._current += nbytes
            if self._current > self._peak:
                self._peak = self._current
            if self._phase is not None and self._current > self._phase_peaks.get(self._phase, 0):
                self._phase_peaks[self._phase] = self._current

    def _release(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, None)
            if nbytes is not None:
                self._current -= nbytes

    def _observe(self, args: tuple, kwargs: dict, out: Any) -> int:
        """Count the new storages among ``out``; return the bytes they added."""
        inputs: set[int | None] | None = None  # built only when an output storage is not known yet
        added = 0
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested, ... : no plain storage
                continue
            key = storage._cdata
            if key in self._live:
                continue
            if inputs is None:
                inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if key in inputs:
                continue
            nbytes = storage.nbytes()
            self._add(key, nbytes)
            weakref.finalize(storage, self._release, key)
            added += nbytes
        return added

    def _over_limit(self, func: Any, added: int) -> torch.OutOfMemoryError | None:
        """The error to raise when the bytes just ``added`` took live memory over the limit."""
        limit = self.budget_bytes
        if not added or limit is None or self._current <= limit:
            return None
        self._last_failure = self._current
        return torch.OutOfMemoryError(
            f"CPU out of memory under batchfit's live-tensor limit: {func} tried to allocate "
            f"{format_bytes(added)} with {format_bytes(self._current - added)} of tensors live "
            f"and a limit of {format_bytes(limit)} "
            f"(DefaultCPUAllocator: can't allocate memory: you tried to allocate {added} bytes)"
        )

    # Meter interface ---------------------------------------------------------------------
    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        with _DispatchObserver(self):
            yield

    def allocated_bytes(self) -> int:
        with self._lock:
            return self._current

    @property
    def baseline_bytes(self) -> int:
        return self._baseline

    def begin_trial(self) -> None:
        with self._lock:
            self._phase_peaks = {}
            self._peak = self._current
            self._last_failure = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            self._phase = name
            self._phase_peaks[name] = max(self._phase_peaks.get(name, 0), self._current)
        try:
            yield
        finally:
            with self._lock:
                self._phase = None

    def failure_bytes(self, message: str) -> int | None:
        # The meter's own limit knows exactly; a real allocator failure states its request.
        return self._last_failure if self._last_failure is not None else super().failure_bytes(message)


class _DispatchObserver(TorchDispatchMode):
    """Hands every dispatched operation's outputs to a :class:`LiveTensorMeter`."""

    def __init__(self, meter: LiveTensorMeter) -> None:
        super().__init__()
        self._meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        error = self._meter._over_limit(func, self._meter._observe(args, kwargs, out))
        if error is not None:
            # A real allocator never hands out the failing block: drop it before raising, so
            # no frame of the traceback keeps it alive while the caller handles the error.
            del out
            raise error
        return out


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


class CudaMeter(Meter):
    """CUDA caching-allocator statistics, and a limit through the per-process memory fraction."""

    def __init__(self, device: torch.device, budget_bytes: int | None, limit_bytes: int | None) -> None:
        super().__init__()
        self.device = device
        self.total_bytes = torch.cuda.get_device_properties(device).total_memory
        self.budget_bytes = budget_bytes
        self._limit = limit_bytes
        self._phase_start = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self._limit is None:
            yield
            return
        previous = torch.cuda.get_per_process_memory_fraction(self.device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, self._limit / self.total_bytes), self.device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(previous, self.device)

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def begin_trial(self) -> None:
        super().begin_trial()
        torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            self.synchronize()
            peak = torch.cuda.max_memory_allocated(self.device)
            self._phase_peaks[name] = max(self._phase_peaks.get(name, 0), peak)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release(self, target_bytes: int | None = None) -> None:
        super().release(target_bytes)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)


_REQUEST = re.compile(
    r"(?:tried to allocate|Tried to allocate)\s+([0-9.]+)\s*(bytes|B|KiB|MiB|GiB|TiB)?", re.IGNORECASE
)
_SCALE = {"bytes": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def requested_bytes(message: str) -> int | None:
    """The size of the failing request, from a CUDA or CPU allocator message, if stated."""
    match = _REQUEST.search(message)
    if not match:
        return None
    unit = (match.group(2) or "bytes").lower()
    return int(float(match.group(1)) * _SCALE[unit])


def available_host_bytes() -> int | None:
    """MemAvailable from ``/proc/meminfo`` (Linux), else free physical pages, else ``None``."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def total_host_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
