"""The device seam: what a probe needs from a device kind, and the meter every kind provides.

A probe asks a device for seven things, and nothing else in batchfit knows which device it is:

* validate a requested device (`Backend.validate`) and describe it (`Backend.describe`);
* how much memory this process can reach there (`Backend.reachable_bytes`), and what a
  ``memory_limit`` fraction is a fraction of (`Backend.limit_total_bytes`);
* one-time allocations to make before a baseline is taken (`Backend.warm_up`: cuBLAS
  workspaces on CUDA);
* a `Meter` that measures a trial's peak per phase and enforces the limit;
* cached memory to give back (`Backend.empty_cache`) and queued work to wait for
  (`Backend.synchronize`);
* the device's random number generator state, so that it is restored exactly;
* for a ``torchrun`` job: the process group backend, binding a rank to its device, and DDP's
  ``device_ids``.

(Whether an exception left a device unusable is read from the exception alone, in ``oom.py``.)

Two units of memory exist. *Allocated* bytes are what live tensors hold. *Reserved* bytes are
what an allocator holds from the device (allocated plus its cache): on CUDA a memory limit caps
reserved bytes, so the search aims, and the safe batch keeps its headroom, in reserved bytes
there. On the CPU the live-tensor meter's limit counts live tensors, so both units are the same.
`Meter.counts` says which unit the budget counts.
"""

from __future__ import annotations

import contextlib
import gc
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass

from batchfit.errors import UncountableMemoryError
from batchfit.interrupts import InterruptGuard
from batchfit.report import DeviceInfo, Unit
from batchfit.report.records import AllocatorFacts


class Meter:
    """Peak memory of a trial per phase, and the memory limit, for one probe on one device.

    The trial runner calls `begin_trial`, then runs the steps inside `tracking`,
    each phase inside `phase`; it reads `phase_peaks` (allocated bytes) and
    `phase_reserved_peaks` (reserved bytes) afterwards.
    """

    device: torch.device
    budget_bytes: int | None
    counts: Unit = "allocated"
    #: Whether memory kept from one trial shapes the next one's layout (a caching allocator
    #: carves later blocks around it): then the largest fit is confirmed from scratch.
    layout_carries: bool = False

    def __init__(self) -> None:
        self._phase_peaks: dict[str, int] = {}
        self._phase_reserved: dict[str, int] = {}
        #: Set by the probe: raises a Ctrl-C deferred while the probe runs (``batchfit.interrupts``).
        self.interrupts: InterruptGuard | None = None
        #: Set by a soak (``batchfit.probe.soak``): `release` leaves a caching allocator's cache as
        #: it is between trials, as a training loop does between steps, so the cache fragments as
        #: it would in the run (a search empties it, so that no trial inherits another's layout).
        self.keeps_cache = False

    def checkpoint(self) -> None:
        """A safe point: raise a Ctrl-C that arrived since the last one."""
        if self.interrupts is not None:
            self.interrupts.check()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Apply the limit for the lifetime of a probe and undo it afterwards."""
        yield

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Measure the code inside (a trial's steps)."""
        yield

    #: Whether the meter's bookkeeping runs inside every operation (the CPU's live-tensor meter, a
    #: dispatch mode): it adds a fixed cost to every step, ~50 ms on a small GPT-2's, whatever the batch.
    observes_operations: bool = False

    @contextlib.contextmanager
    def unobserved(self) -> Iterator[None]:
        """Run the code inside without per-operation bookkeeping: a timing trial's timed steps, whose
        memory its untimed step measured, timed as a plain loop runs them (a no-op for a meter
        without any: memory statistics cost a step nothing)."""
        if not self.observes_operations:
            yield
            return
        with _disable_current_modes():
            yield

    @contextlib.contextmanager
    def capped(self, cap_bytes: int | None) -> Iterator[None]:
        """Run the code inside under a lower limit, ``cap_bytes`` (``None``: no change).

        What a headroom means: the safe batch must *run* under ``(1 - headroom) x budget``, not
        merely show a peak below it under the full budget (an allocator that caches until the cap
        shows a peak of about the cap at every size near it). Meters whose limit is
        ``budget_bytes`` lower it for the duration; the allocator meter lowers its cap.
        """
        if cap_bytes is None or (self.budget_bytes is not None and cap_bytes >= self.budget_bytes):
            yield
            return
        budget, self.budget_bytes = self.budget_bytes, cap_bytes
        try:
            yield
        finally:
            self.budget_bytes = budget

    def allocated_bytes(self) -> int:
        """Memory that live tensors hold on the device now, as this meter counts it."""
        raise NotImplementedError

    def reserved_bytes(self) -> int:
        """Memory the allocator holds from the device now (allocated plus its cache)."""
        return self.allocated_bytes()

    def notes(self) -> list[str]:
        """What a reader of the answer should know about how this meter counted the trials."""
        return []

    # what fits, as the allocator decides it (docs/concepts/measuring.md#what-fits-on-cuda) --------------
    def trial_facts(self) -> AllocatorFacts | None:
        """What the allocator did during the last trial's steps (``None``: this meter cannot say). Read
        after the steps, before their memory is released (the segments they used are still held)."""
        return None

    def refusal(self) -> tuple[str, str] | None:
        """Why the last trial's steps, which raised no out-of-memory error, still do not fit under this
        allocator's rule, and the phase where it showed: ``(phase, reason)``; ``None`` when they fit."""
        return None

    def layout(self) -> tuple[int, ...]:
        """The allocator's layout at the end of a step: a replay of a fresh process (`fresh_process`)
        runs steps until it stops changing."""
        return (self.reserved_bytes(),)

    @contextlib.contextmanager
    def fresh_process(self) -> Iterator[None]:
        """Run the trial inside as a fresh training process meets the device: for a caching allocator,
        nothing cached and the one-time workspaces not made yet (they are carved out of the step's
        own segments, as a fresh process carves them). A no-op where nothing carries between trials."""
        yield

    def held_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """What ``tensors`` add to `allocated_bytes` (each storage once)."""
        storages = {s._cdata: s for t in tensors for s in data_storages(t)}
        return sum(self._storage_bytes(storage) for storage in storages.values())

    def _storage_bytes(self, storage: torch.UntypedStorage) -> int:
        return storage.nbytes()

    def begin_trial(self) -> None:
        self._phase_peaks = {}
        self._phase_reserved = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the peak of the code inside under ``name``."""
        raise NotImplementedError
        yield  # pragma: no cover

    def phase_peaks(self) -> dict[str, int]:
        """Peak allocated bytes per phase of the last trial."""
        return dict(self._phase_peaks)

    def phase_reserved_peaks(self) -> dict[str, int]:
        """Peak reserved bytes per phase of the last trial."""
        return dict(self._phase_reserved) if self._phase_reserved else dict(self._phase_peaks)

    def failure_bytes(self, message: str) -> tuple[int | None, int | None]:
        """Lower bounds of what a failed step needed, ``(allocated, reserved)``.

        Read inside the ``except`` of an OOM, while the failed step's tensors are still
        referenced. The base rule: live memory plus the request the message states (``None``
        where it states none). Allocators that round requests override this.
        """
        requested = requested_bytes(message)
        if requested is None:
            return None, None
        return self.allocated_bytes() + requested, self.reserved_bytes() + requested

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


class Backend:
    """What a probe needs from one kind of device. One instance per device type; stateless."""

    #: ``torch.device.type`` this backend serves.
    type: str = ""
    #: Whether a ``torch.compile``d model can run compiled under this backend's meter. The CPU
    #: meter is a dispatch mode: dynamo skips frames under it and remembers the skip, so a
    #: compiled model probed there would never compile again in the process.
    runs_compiled: bool = True
    #: Whether the first step after the memory was released runs cold (device allocations,
    #: first use of each shape, kernels loaded on first launch): then it is not the one timed.
    cold_after_release: bool = False

    def validate(self, device: torch.device) -> torch.device:
        """``device`` with its index resolved; ``ValueError`` when it is not there."""
        raise NotImplementedError

    def describe(self, device: torch.device) -> DeviceInfo:
        raise NotImplementedError

    def limit_total_bytes(self, device: torch.device) -> int | None:
        """What a fractional ``memory_limit`` (``0.8``) is a fraction of."""
        raise NotImplementedError

    def default_limit(self, device: torch.device) -> tuple[int | None, str]:
        """The limit without ``memory_limit`` (``None``: the device's reachable memory), and a
        phrase that says where it came from."""
        return None, "device"

    def reachable_bytes(self, device: torch.device) -> int | None:
        """Memory this process can use on ``device`` now (``None`` when unknown)."""
        return None

    def outside_allocator_bytes(self, device: torch.device) -> int:
        """Memory in use on the device that the allocator does not hold (context, handles,
        other processes); what ``reserve="auto"`` sets aside. 0 where there is no such thing."""
        return 0

    def warm_up(self, device: torch.device, amp_dtype: torch.dtype | None) -> None:
        """Make the one-time allocations a first step would make, before a baseline is taken."""

    def clear_workspaces(self, device: torch.device) -> None:
        """Free what `warm_up` made (the cuBLAS workspaces), so that a replay of a fresh process makes it
        again inside its first step; `warm_up` puts it back."""

    def make_meter(
        self, device: torch.device, budget_bytes: int | None, limit_bytes: int | None, tensors: list[torch.Tensor]
    ) -> Meter:
        """A meter for one probe. ``budget_bytes``: what trials may use; ``limit_bytes``: the
        user's limit to enforce (``None``: none); ``tensors``: what the probe holds before its
        first trial (weights, buffers, the sample), for meters that must count it themselves."""
        raise NotImplementedError

    def empty_cache(self, device: torch.device) -> None:
        """Give cached memory back to the device."""

    def synchronize(self, device: torch.device) -> None:
        """Wait for the device's queued work."""

    def get_rng_state(self, device: torch.device) -> Any:
        """The device's random number generator state (``None``: nothing to restore)."""
        return None

    # Many ranks (``batchfit.distributed.launch``) ----------------------------------------------------------
    #: The ``torch.distributed`` backend for the data of a job on this device kind.
    process_group_backend: str = "gloo"

    def bind(self, device: torch.device) -> None:
        """Make ``device`` this process's current device of its kind (a rank takes its GPU)."""

    def ddp_device_ids(self, device: torch.device) -> list[int] | None:
        """``device_ids`` for ``DistributedDataParallel`` of a model on ``device``."""
        return None

    def set_rng_state(self, device: torch.device, state: Any) -> None:
        """Restore what `get_rng_state` returned."""


def data_storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold ``tensor``'s data, whatever its layout.

    A strided tensor has one. A sparse tensor has none of its own: its indices and values do
    (COO: ``indices``, ``values``; CSR/BSR: ``crow_indices``, ``col_indices``, ``values``;
    CSC/BSC: ``ccol_indices``, ``row_indices``, ``values``). A wrapper subclass (a jagged nested
    tensor) holds inner tensors, named by its ``__tensor_flatten__``: their storages, not the
    wrapper's (which aliases one of them, so counting both counted it twice). Anything else
    (MKL-DNN) raises `UncountableMemoryError`: memory a meter cannot see
    must stop a probe, never be taken as free.
    """
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in names]  # a DTensor's names also hold its mesh
        return [storage for part in inner if isinstance(part, torch.Tensor) for storage in data_storages(part)]
    layout = tensor.layout
    if layout == torch.strided:
        return [tensor.untyped_storage()]
    if layout == torch.sparse_coo:
        parts = (tensor._indices(), tensor._values())
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (tensor.crow_indices(), tensor.col_indices(), tensor.values())
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (tensor.ccol_indices(), tensor.row_indices(), tensor.values())
    else:
        raise UncountableMemoryError(
            f"batchfit cannot count the memory of a {layout} tensor ({tuple(tensor.shape)}, {tensor.dtype}): "
            "it has no storage to measure. Keep the training step on strided or sparse tensors "
            + ("(to_mkldnn() is for inference kernels)" if layout == torch._mkldnn else "")
        )
    return [storage for part in parts for storage in data_storages(part)]


def requested_bytes(message: str) -> int | None:
    """The size an allocator message says it tried to allocate, if it states one.

    On CUDA's native allocator this is the rounded segment the caching allocator tried to
    reserve (a 3 MiB request reads "Tried to allocate 20.00 MiB"), not the tensor's size: a bound
    in reserved bytes, not in allocated bytes. Under ``backend:cudaMallocAsync`` it is the request
    itself, unrounded, from the "Requested               : 20.00 MiB" line of its "would exceed
    allowed memory" message (c10/cuda/CUDAMallocAsyncAllocator.cpp), which that allocator checks
    against the bytes in use. The CPU allocator states bytes ("you tried to allocate 4398046511104
    bytes"). Every unit is binary: torch's ``format_size`` divides by 1024, also where older MPS
    builds printed "KB", "MB", "GB".
    """
    match = _REQUESTED.search(message)
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2) or "bytes"])


#: "Tried to allocate N UNIT" (native allocators of CUDA, HIP, XPU, MPS; the CPU allocator in
#: lower case) or cudaMallocAsync's "Requested : N UNIT" line, with ``format_size``'s units.
_REQUESTED = re.compile(
    r"(?:(?i:tried to allocate)|\bRequested\s*:)\s*([0-9]+(?:\.[0-9]+)?)\s*(bytes|[KMGT]i?B|B)?(?![A-Za-z])"
)
_UNITS = {"bytes": 1, "B": 1} | {
    f"{prefix}{infix}B": 1024 ** (power + 1) for power, prefix in enumerate("KMGT") for infix in ("i", "")
}
