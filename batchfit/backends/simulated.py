"""A meter that models CUDA memory from a trace on fake CPU tensors (for ``batchfit.estimation``).

It is the live-tensor meter (``batchfit.backends.cpu``), which sees every storage a step creates
and frees, with each creation and release also handed to a model of PyTorch's CUDA caching
allocator (``batchfit.backends.allocator_model``): allocated bytes are the allocator's blocks (512-byte
rounding, unsplit remainders), reserved bytes its segments. As on a real GPU under
``set_per_process_memory_fraction``, the limit caps *reserved* bytes: it is the model's
``limit_bytes``, under which a new storage that would take the reservation over it first makes the
allocator give cached memory back (garbage collection, oversize blocks, every free segment), and
only if it is still over is it an out-of-memory. The allocator's settings are the process's
``PYTORCH_CUDA_ALLOC_CONF`` (``batchfit.backends.alloc_conf``), as a probe on the GPU would meet them.

The fixed costs the caching allocator holds beside the model are allocated when the meter is made:
the cuBLAS and cuBLASLt workspaces of the forward thread and of autograd's backward thread
(`CUBLAS_HANDLES` x `CUBLAS_WORKSPACE_BYTES`, sm90 sizes). What lives outside the
allocator (the CUDA context, NCCL) is the caller's ``reserve``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from batchfit.backends.alloc_conf import AllocatorConfig
from batchfit.backends.allocator_model import CachingAllocatorModel
from batchfit.backends.cpu import LiveTensorMeter
from batchfit.report import Unit
from batchfit.units import format_bytes

#: cuBLAS (32 MiB) plus cuBLASLt (1 MiB) workspace of one handle on sm90 (H100, H200).
CUBLAS_WORKSPACE_BYTES = 33 * 2**20
#: Threads that run matmuls in a training step, each with its own handle: forward, backward.
CUBLAS_HANDLES = 2


class SimulatedCudaMeter(LiveTensorMeter):
    """The live-tensor meter's trace, counted as the CUDA caching allocator would (module docs).

    ``config``: the allocator's settings; ``None`` reads them from the environment as torch does
    (`AllocatorConfig.from_environ`), so an estimate honours the ``PYTORCH_CUDA_ALLOC_CONF`` a
    training run of this process would. ``backend:cudaMallocAsync`` is refused with a
    ``ValueError``: the model is of the native caching allocator, and how much the CUDA driver's pool
    reserves is the driver's to decide, so an estimate under it would be a guess presented as a model.
    """

    counts: Unit = "reserved"
    layout_carries = True
    scratch_note = (
        "the steps ran {ops}: the workspace cuDNN takes inside such an operation is not modelled, so the "
        "estimate may be a little high; the safe batch's headroom covers it"
    )

    def __init__(
        self, budget_bytes: int | None, tensors: Iterable[torch.Tensor] = (), config: AllocatorConfig | None = None
    ) -> None:
        self.config = AllocatorConfig.from_environ(os.environ) if config is None else config
        if self.config.backend != "native":
            source = self.config.variable or "the allocator configuration"
            raise ValueError(
                f"{source} sets backend:{self.config.backend}, and a CUDA estimate models the native caching "
                "allocator only: unset it for the estimate, or measure on the GPU with batchfit.find "
                "(see docs/concepts/measuring.md#allocator-settings)"
            )
        self.allocator = CachingAllocatorModel(self.config)
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
            self._largest_request = max(self._largest_request, self._live[key])
            # The cap is the allocator's memory fraction: past it, the model gives cached memory back
            # before it reserves more, and notes the request it would have refused (_over_limit).
            self.allocator.limit_bytes = self.budget_bytes
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
        # An out-of-memory is a request the allocator refused (not reserved bytes over the cap: under
        # expandable segments the pages mapped may overshoot it by less than a page, and torch allows that).
        limit = self.budget_bytes
        if (added <= 0 and not anywhere) or limit is None:
            return None
        with self._lock:
            failure = self.allocator.pop_failure()
            if failure is None:
                return None
            self._last_failure, reserved = failure
            self._last_reserved_failure = reserved
        return torch.OutOfMemoryError(
            f"CUDA out of memory (modelled): {func} needed more memory than the limit of {format_bytes(limit)} "
            f"allows, even with every cached block given back: {format_bytes(reserved)} reserved with it, "
            f"{format_bytes(self._last_failure)} allocated"
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
    def capped(self, cap_bytes: int | None) -> Iterator[None]:
        """The allocator meter's `capped`: the cache is emptied first (a cached block is handed
        out without a check against the cap), then the model's limit is the lower cap."""
        if cap_bytes is not None and (self.budget_bytes is None or cap_bytes < self.budget_bytes):
            with self._lock:
                self.allocator.empty_cache()
        with super().capped(cap_bytes):
            yield

    def assumptions(self) -> tuple[str, ...]:
        """What the allocator's settings mean for the estimate, in words (one line per setting)."""
        if self.config.variable is None and not self.config.changes():
            return ("the caching allocator at its default settings (PYTORCH_CUDA_ALLOC_CONF unset)",)
        source = f"{self.config.variable}={self.config.text!r}" if self.config.variable else "allocator settings"
        changes = self.config.changes() or ("torch's defaults",)
        return tuple(f"{source}: {change}" for change in changes)

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
#: What a CUDA 12 process keeps outside the caching allocator, ``(low, high)``: the context alone
#: (lazy module loading, the default since CUDA 12.2 under torch) to the context with the kernels a
#: training step loads and its cuBLAS/cuDNN handles. Where in the range a process lands depends on
#: the GPU, the driver and which libraries the step touches: it is a range, not a number.
CUDA_CONTEXT_RANGE = (512 * 2**20, 2**30)
#: What an estimate takes off the memory for it when nobody says: the top of the range. Assuming
#: the top errs safe: a context larger than assumed would make the estimate's answer run out of
#: memory on the real card, which is what an estimate is for avoiding; one smaller than assumed
#: costs at most 512 MiB of budget (under 1% of an 80 GiB card), which the answer under-uses.
CUDA_CONTEXT_BYTES = CUDA_CONTEXT_RANGE[1]
#: hipBLAS workspace of one handle under ROCm: torch's default on gfx942/gfx950 (MI300, MI350);
#: other ROCm GPUs take 32 MiB (the larger is assumed: the estimate errs safe).
HIPBLAS_WORKSPACE_BYTES = 128 * 2**20
#: hipBLASLt workspace of one handle under ROCm: torch's default (``HIPBLASLT_WORKSPACE_SIZE`` unset).
HIPBLASLT_WORKSPACE_BYTES = 76 * 2**20


@dataclass(frozen=True)
class EstimateTarget:
    """A device kind an estimate can be for: the unit its budget counts, the meter that counts
    a fake trace as that device would, what lives outside its allocator by default, and the
    assumptions the result must list.

    ``runs_as``: the torch device type, where it is not ``name`` (a ROCm GPU is torch's ``cuda``
    device, with other libraries): the type a result records, and what decides how torch's
    optimizers step. ``workspaces``: the blocks the BLAS handles hold in the allocator, in place of
    the meter's cuBLAS ones (``None``: those). ``variants``: targets of the same device type with
    another stack, reached by their own name through `estimate_target`. ``context_note``:
    what the default outside-the-allocator bytes stand for, said when they are used."""

    name: str
    counts: Unit
    outside_allocator_bytes: int
    assumptions: tuple[str, ...]
    amp_assumption: str | None
    runs_as: str | None = None
    workspaces: tuple[int, ...] | None = None
    variants: tuple[EstimateTarget, ...] = ()
    context_note: str | None = None

    @property
    def device_type(self) -> str:
        """The torch device type a real run on this target has."""
        return self.runs_as or self.name

    def make_meter(self, budget_bytes: int, tensors: Iterable[torch.Tensor]) -> LiveTensorMeter:
        if self.counts != "reserved":
            return LiveTensorMeter(budget_bytes, None, tensors=tensors)
        meter = SimulatedCudaMeter(budget_bytes, tensors)
        if self.workspaces is not None:
            _hold_workspaces(meter, self.workspaces)
        return meter


def _hold_workspaces(meter: SimulatedCudaMeter, sizes: tuple[int, ...]) -> None:
    """Give the meter's cuBLAS workspace blocks back and hold ``sizes`` instead (before any step:
    the baseline and the peak start again from the allocator's count)."""
    with meter._lock:
        for handle in meter._fixed:
            meter.allocator.free(handle)
        meter.allocator.empty_cache()
        meter._fixed = [meter.allocator.malloc(size) for size in sizes]
        meter._current = meter._baseline = meter._peak = meter.allocator.allocated_bytes


_ALLOCATOR_MODELLED = (
    "CUDA memory is modelled, not measured: the caching allocator's rounding (512 B) and segments "
    "(2 MiB for requests up to 1 MiB, 20 MiB up to 10 MiB, larger ones rounded to 2 MiB), the budget "
    "counting reserved bytes"
)
_CPU_OPERATORS = (
    "the step's operators and their saved tensors are the CPU's (kernels that keep other tensors on "
    "CUDA, such as fused attention's, are not modelled)"
)
_CPU_AUTOCAST = "the CPU's autocast casting rules, which cast fewer operators than CUDA's"
_CONTEXT_RANGE = f"{format_bytes(CUDA_CONTEXT_RANGE[0])} to {format_bytes(CUDA_CONTEXT_RANGE[1])}"

ROCM_TARGET = EstimateTarget(
    "rocm",
    "reserved",
    CUDA_CONTEXT_BYTES,
    (
        _ALLOCATOR_MODELLED + " (PyTorch's caching allocator is the same code under ROCm)",
        f"hipBLAS and hipBLASLt workspaces: {CUBLAS_HANDLES} x ({format_bytes(HIPBLAS_WORKSPACE_BYTES)} + "
        f"{format_bytes(HIPBLASLT_WORKSPACE_BYTES)}) (forward and backward threads; torch's defaults on "
        "gfx942/gfx950, MI300/MI350: other ROCm GPUs take 32 MiB of hipBLAS workspace) held by the allocator",
        _CPU_OPERATORS.replace("CUDA", "the GPU"),
    ),
    _CPU_AUTOCAST.replace("CUDA's", "ROCm's"),
    runs_as="cuda",
    workspaces=(HIPBLAS_WORKSPACE_BYTES, HIPBLASLT_WORKSPACE_BYTES) * CUBLAS_HANDLES,
    context_note=(
        f"the HIP runtime's context, kernels and handles: assumed the size of CUDA's, whose range is {_CONTEXT_RANGE}, "
        "at its top (not measured under ROCm; reserve=, --reserve on the command line, sets it)"
    ),
)

ESTIMATE_TARGETS: dict[str, EstimateTarget] = {
    "cpu": EstimateTarget("cpu", "allocated", 0, (), None),
    "cuda": EstimateTarget(
        "cuda",
        "reserved",
        CUDA_CONTEXT_BYTES,
        (
            _ALLOCATOR_MODELLED,
            f"cuBLAS workspaces: {CUBLAS_HANDLES} x {format_bytes(CUBLAS_WORKSPACE_BYTES)} (forward and backward "
            "threads, sm90 sizes) held by the allocator",
            _CPU_OPERATORS,
        ),
        _CPU_AUTOCAST,
        variants=(ROCM_TARGET,),
        context_note=(
            f"the CUDA context with its lazily loaded kernels and the cuBLAS/cuDNN handles, {_CONTEXT_RANGE} "
            "under CUDA 12 depending on the GPU, the driver and the libraries a step loads: the top is assumed, "
            "so the estimate errs safe (reserve=, --reserve on the command line, sets it)"
        ),
    ),
}
#: What ``batchfit estimate`` estimates for when nobody says: the device people rent.
DEFAULT_ESTIMATE_TARGET = "cuda"


def estimate_target(name: str) -> EstimateTarget:
    """The target called ``name`` (a device type, or a variant's name such as ``"rocm"``);
    ``ValueError`` naming the known ones."""
    known = {target.name: target for base in ESTIMATE_TARGETS.values() for target in (base, *base.variants)}
    try:
        return known[name]
    except (KeyError, TypeError):
        names = ", ".join(repr(k) for k in known)
        raise ValueError(f"device must be one of {names} for an estimate, got {name!r}") from None
