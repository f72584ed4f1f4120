"""A meter that models CUDA memory from a trace on fake CPU tensors (for ``batchfit.estimation``).

It is the live-tensor meter (``batchfit.backends.cpu``), which sees every storage a step creates
and frees, with each creation and release also handed to a model of PyTorch's CUDA caching
allocator (``batchfit.backends.allocator_model``): allocated bytes are the allocator's blocks (512-byte
rounding, unsplit remainders), reserved bytes its segments. As on a real GPU under
``set_per_process_memory_fraction``, the limit caps *reserved* bytes: when a new storage would
take the reservation over it, entirely free cached segments are given back first (the allocator
does that before it fails), and only if it is still over is it an out-of-memory.

The fixed costs the caching allocator holds beside the model are allocated when the meter is made:
the cuBLAS and cuBLASLt workspaces of the forward thread and of autograd's backward thread
(:data:`CUBLAS_HANDLES` x :data:`CUBLAS_WORKSPACE_BYTES`, sm90 sizes). What lives outside the
allocator (the CUDA context, NCCL) is the caller's ``reserve``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from batchfit.backends.allocator_model import CachingAllocatorModel
from batchfit.backends.cpu import LiveTensorMeter
from batchfit.report import Unit
from batchfit.units import format_bytes

#: cuBLAS (32 MiB) plus cuBLASLt (1 MiB) workspace of one handle on sm90 (H100, H200).
CUBLAS_WORKSPACE_BYTES = 33 * 2**20
#: Threads that run matmuls in a training step, each with its own handle: forward, backward.
CUBLAS_HANDLES = 2


class SimulatedCudaMeter(LiveTensorMeter):
    """The live-tensor meter's trace, counted as the CUDA caching allocator would (module docs)."""

    counts: Unit = "reserved"
    scratch_note = (
        "the steps ran {ops}: the workspace cuDNN takes inside such an operation is not modelled, so the "
        "estimate may be a little high; the safe batch's headroom covers it"
    )

    def __init__(self, budget_bytes: int | None, tensors: Iterable[torch.Tensor] = ()) -> None:
        self.allocator = CachingAllocatorModel()
        self._handles: dict[int, int] = {}
        self._fixed = [self.allocator.malloc(size) for _ in range(CUBLAS_HANDLES) for size in (32 * 2**20, 2**20)]
        self._phase_reserved_now: dict[str, int] = {}
        super().__init__(budget_bytes, None, baseline_bytes=0, tensors=tensors)
        with self._lock:
            self._current = self._baseline = self._peak = self.allocator.allocated_bytes

    # accounting: every storage is a block ----------------------------------------------------------
    def _add(self, key: int, nbytes: int) -> None:
        with self._lock:
            previous = self._handles.pop(key, None)
            if previous is not None:  # a storage that grew in place: a new block, the old one freed
                self.allocator.free(previous)
            self._live[key] = self._live.get(key, 0) + nbytes
            limit = self.budget_bytes
            wanted = self.allocator.would_reserve(self._live[key])
            if limit is not None and self.allocator.reserved_bytes + wanted > limit:
                # Past the cap the allocator gives its cached segments back before it reserves more.
                self.allocator.empty_cache()
            self._handles[key] = self.allocator.malloc(self._live[key])
            self._sync()

    def _release(self, key: int) -> None:
        with self._lock:
            self._live.pop(key, None)
            self._finalizers.pop(key, None)
            handle = self._handles.pop(key, None)
            if handle is not None:
                self.allocator.free(handle)
                self._current = self.allocator.allocated_bytes

    def _sync(self) -> None:
        """Current allocated bytes, and the peaks of both units (caller holds the lock)."""
        self._current = self.allocator.allocated_bytes
        self._peak = max(self._peak, self._current)
        if self._phase is not None:
            self._phase_peaks[self._phase] = max(self._phase_peaks.get(self._phase, 0), self._current)
            reserved = self.allocator.reserved_bytes
            self._phase_reserved[self._phase] = max(self._phase_reserved.get(self._phase, 0), reserved)

    def _over_limit(self, func: object, added: int, anywhere: bool = False) -> torch.OutOfMemoryError | None:
        limit = self.budget_bytes
        if (added <= 0 and not anywhere) or limit is None:
            return None
        with self._lock:
            reserved = self.allocator.reserved_bytes
            if reserved <= limit:
                return None
            self._last_failure = self._current
            self._last_reserved_failure = reserved
        return torch.OutOfMemoryError(
            f"CUDA out of memory (modelled): {func} took the reserved memory to {format_bytes(reserved)}, over the "
            f"limit of {format_bytes(limit)}, with {format_bytes(self._current)} allocated"
        )

    # Meter interface -------------------------------------------------------------------------------
    def _storage_bytes(self, storage: torch.UntypedStorage) -> int:
        with self._lock:
            handle = self._handles.get(storage._cdata)
            return 0 if handle is None else self.allocator.block_bytes(handle)

    def reserved_bytes(self) -> int:
        with self._lock:
            return self.allocator.reserved_bytes

    def begin_trial(self) -> None:
        super().begin_trial()
        self._phase_reserved = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            self._phase_reserved[name] = max(self._phase_reserved.get(name, 0), self.allocator.reserved_bytes)
        with super().phase(name):
            yield

    def failure_bytes(self, message: str) -> tuple[int | None, int | None]:
        if self._last_failure is not None:
            return self._last_failure, getattr(self, "_last_reserved_failure", None)
        return None, None

    def release(self, target_bytes: int | None = None) -> None:
        super().release(target_bytes)
        # Between trials a probe empties the cache (``Backend.empty_cache``): so does the model.
        with self._lock:
            self.allocator.empty_cache()


# What an estimate is for ------------------------------------------------------------------------
#: What the CUDA context takes outside the caching allocator when nobody says (an assumption).
CUDA_CONTEXT_BYTES = 512 * 2**20


@dataclass(frozen=True)
class EstimateTarget:
    """A device kind an estimate can be for: the unit its budget counts, the meter that counts
    a fake trace as that device would, what lives outside its allocator by default, and the
    assumptions the result must list."""

    name: str
    counts: Unit
    outside_allocator_bytes: int
    assumptions: tuple[str, ...]
    amp_assumption: str | None

    def make_meter(self, budget_bytes: int, tensors: Iterable[torch.Tensor]) -> LiveTensorMeter:
        if self.counts == "reserved":
            return SimulatedCudaMeter(budget_bytes, tensors)
        return LiveTensorMeter(budget_bytes, None, tensors=tensors)


ESTIMATE_TARGETS: dict[str, EstimateTarget] = {
    "cpu": EstimateTarget("cpu", "allocated", 0, (), None),
    "cuda": EstimateTarget(
        "cuda",
        "reserved",
        CUDA_CONTEXT_BYTES,
        (
            "CUDA memory is modelled, not measured: the caching allocator's rounding (512 B) and segments "
            "(2 MiB for requests up to 1 MiB, 20 MiB up to 10 MiB, larger ones rounded to 2 MiB), the budget "
            "counting reserved bytes",
            f"cuBLAS workspaces: {CUBLAS_HANDLES} x {format_bytes(CUBLAS_WORKSPACE_BYTES)} (forward and backward "
            "threads, sm90 sizes) held by the allocator",
            "the step's operators and their saved tensors are the CPU's (kernels that keep other tensors on "
            "CUDA, such as fused attention's, are not modelled)",
        ),
        "the CPU's autocast casting rules, which cast fewer operators than CUDA's",
    ),
}
#: What ``batchfit estimate`` estimates for when nobody says: the device people rent.
DEFAULT_ESTIMATE_TARGET = "cuda"


def estimate_target(name: str) -> EstimateTarget:
    """The target called ``name``; ``ValueError`` naming the known ones."""
    try:
        return ESTIMATE_TARGETS[name]
    except (KeyError, TypeError):
        known = ", ".join(repr(k) for k in ESTIMATE_TARGETS)
        raise ValueError(f"device must be one of {known} for an estimate, got {name!r}") from None
