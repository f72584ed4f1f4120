"""The CPU backend: exact live-tensor accounting, and a memory limit that raises a real OOM.

The CPU has no allocator statistics. `LiveTensorMeter` is a ``TorchDispatchMode`` that sees
every operation; each output whose storage is new (not one of the op's inputs', not already
counted) adds ``storage.nbytes()`` to the live total, and a ``weakref.finalize`` on the storage
subtracts it when the storage dies: the exact live-tensor peak of a step, gradients and optimizer
state included. With a limit, the operation that takes live memory over it raises a real
``torch.OutOfMemoryError``, as a GPU of that size would, in the CPU allocator's words
("DefaultCPUAllocator: can't allocate memory") for other libraries' OOM detection.

It also counts a sparse tensor's indices and values and a wrapper subclass's inner tensors (a
jagged nested tensor's values and offsets), each storage once (`data_storages`);
a storage resized in place (``resize_``, ``untyped_storage().resize_()``: at its next operation and
each phase's end); a storage made outside an operation (``torch.UntypedStorage``, a storage's
``clone()``) once an operation uses it; tensors made on Python threads started during a step (each
gets its own observer: dispatch modes are per thread). A tensor with no storage to measure
(``to_mkldnn()``) stops the probe with `UncountableMemoryError`.

It does not see scratch memory a kernel allocates and frees inside itself (CPU convolutions: the
result says so, see `SCRATCH_OPERATORS`), allocator overheads, threads already running when
the step began, or a storage that grows and shrinks back between two operations. So the CPU limit
is one on live *tensor* bytes, well defined and repeatable, not the resident size, and it takes at
most `SAFE_CPU_FRACTION` of the host memory available at the start. Allocated and reserved
bytes are the same number here.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from batchfit.backends.base import Backend, Meter, data_storages
from batchfit.backends.host import available_host_bytes, cpu_name, total_host_bytes
from batchfit.errors import UncountableMemoryError
from batchfit.report import DeviceInfo
from batchfit.report.records import AllocatorFacts
from batchfit.units import format_bytes

#: Without an explicit limit, a CPU probe may use this fraction of the memory available when it starts: the
#: meter does not see kernel scratch memory or allocator overheads, and the rest of the machine needs room.
DEFAULT_CPU_FRACTION = 0.5
#: ... and at most this: a CPU step's time grows with the memory it touches, and a probe under half
#: of a large host took twelve minutes and printed nothing. The limit is what a user asks for more.
DEFAULT_CPU_LIMIT = 2**30
#: A limit takes at most this of what is available at the start (more is clipped, with a note).
SAFE_CPU_FRACTION = 0.75


def cap_words(available_bytes: int) -> str:
    """Why a CPU limit was capped (`CpuBackend.reachable_bytes`): the note's words, and the CLI header's."""
    return (
        f"a memory limit takes at most {SAFE_CPU_FRACTION:.0%} of the host memory available when the probe starts "
        f"({format_bytes(available_bytes)}), the rest left for what the meter does not see and the rest of the "
        "machine; batchfit.estimate() sizes a larger device"
    )


class CpuBackend(Backend):
    """The host: live-tensor meter, host memory from ``/proc/meminfo``, the CPU generator."""

    type = "cpu"
    runs_compiled = False

    def validate(self, device: torch.device) -> torch.device:
        return torch.device("cpu")

    def describe(self, device: torch.device) -> DeviceInfo:
        return DeviceInfo(
            type="cpu",
            index=None,
            name=cpu_name(),
            total_bytes=total_host_bytes(),
            config=(("torch threads", str(torch.get_num_threads())),),
        )

    def limit_total_bytes(self, device: torch.device) -> int | None:
        # A fraction of what is free now: the rest of the host is somebody else's.
        return available_host_bytes()

    def default_limit(self, device: torch.device) -> tuple[int | None, str]:
        available = available_host_bytes()
        if available is None:
            raise ValueError("cannot read the host's available memory: pass memory_limit=")
        half = int(available * DEFAULT_CPU_FRACTION)
        if half > DEFAULT_CPU_LIMIT:
            return DEFAULT_CPU_LIMIT, (
                f"default on the CPU: {format_bytes(DEFAULT_CPU_LIMIT)} of live tensors (a step's time grows with the "
                "memory it touches); pass memory_limit= for more"
            )
        return half, f"default: {DEFAULT_CPU_FRACTION:.0%} of available host memory"

    def reachable_bytes(self, device: torch.device) -> int | None:
        available = available_host_bytes()  # a limit near all of it would take the host down
        return None if available is None else int(available * SAFE_CPU_FRACTION)

    def make_meter(
        self, device: torch.device, budget_bytes: int | None, limit_bytes: int | None, tensors: list[torch.Tensor]
    ) -> Meter:
        # The meter counts storages it sees created; what exists before the probe it is told.
        said: list[str] = []
        if budget_bytes is not None and limit_bytes is not None and budget_bytes < limit_bytes:  # clipped to reach
            said.append(f"on the CPU {cap_words(int(budget_bytes / SAFE_CPU_FRACTION))}")
        return LiveTensorMeter(budget_bytes, total_host_bytes(), tensors=tensors, notes=said)

    # The CPU generator is saved and restored by the snapshot for every probe, whatever the device.


class LiveTensorMeter(Meter):
    """Exact live-tensor accounting on the CPU, with an optional limit (see module docs)."""

    observes_operations = True  # its bookkeeping runs inside every operation: see Meter.unobserved

    def __init__(
        self,
        budget_bytes: int | None,
        total_bytes: int | None,
        baseline_bytes: int = 0,
        tensors: Iterable[torch.Tensor] = (),
        notes: Iterable[str] = (),
    ) -> None:
        """``baseline_bytes``: bytes live before the probe that the meter is told of;
        ``tensors``: tensors live before the probe (weights, buffers, the sample), whose
        storages are tracked like the probe's own, so that growing one in place is seen;
        ``notes``: what the result should say about the limit (`CpuBackend.make_meter`)."""
        super().__init__()
        self._said = list(notes)
        self.device = torch.device("cpu")
        self.budget_bytes = budget_bytes
        self.total_bytes = total_bytes
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._tracking = False
        #: Operators seen in the steps that allocate scratch memory inside themselves (unseen).
        self.scratch_ops: set[torch._ops.OpOverload] = set()
        self._baseline = baseline_bytes
        self._current = baseline_bytes
        self._peak = baseline_bytes
        self._phase: str | None = None
        self._last_failure: int | None = None
        #: The largest single allocation of the trial (what a safe batch's headroom must hold one more of).
        self._largest_request = 0
        for tensor in tensors:
            for storage in _storages_of(tensor):
                if storage._cdata not in self._live:
                    self._track(storage)
        self._baseline = self._current

    # accounting --------------------------------------------------------------------------
    def _add(self, key: int, nbytes: int) -> None:
        """``nbytes`` more are live under ``key`` (a new storage, or one that grew)."""
        with self._lock:
            self._live[key] = self._live.get(key, 0) + nbytes
            self._current += nbytes
            if nbytes > self._largest_request:
                self._largest_request = nbytes
            if self._current > self._peak:
                self._peak = self._current
            if self._phase is not None and self._current > self._phase_peaks.get(self._phase, 0):
                self._phase_peaks[self._phase] = self._current

    def _track(self, storage: torch.UntypedStorage) -> int:
        key, nbytes = storage._cdata, storage.nbytes()
        self._add(key, nbytes)
        self._finalizers[key] = weakref.finalize(storage, self._release, key)
        self._storages[key] = weakref.ref(storage)
        return nbytes

    def _release(self, key: int) -> None:
        # A weakref callback: bookkeeping only, nothing that can raise (it would be printed and dropped).
        with self._lock:
            nbytes = self._live.pop(key, None)
            self._finalizers.pop(key, None)
            self._storages.pop(key, None)
            if nbytes is not None:
                self._current -= nbytes

    def _observe(self, args: tuple, kwargs: dict, out: Any) -> int:
        """Count the new storages among ``out``, and the growth of known ones (``resize_``,
        ``out=``); return the bytes they added (negative where a known storage shrank)."""
        inputs: set[int] | None = None  # built only when an output storage is not known yet
        added = 0
        for tensor in _tensors_in(out):
            for storage in _storages_of(tensor):
                key = storage._cdata
                known = self._live.get(key)
                if known is not None:
                    added += self._resize(key, storage, known)
                    continue
                if inputs is None:
                    inputs = _input_keys(args, kwargs)
                if key in inputs:
                    continue
                added += self._track(storage)
        return added

    def _adopt(self, tensor: torch.Tensor) -> int:
        """Count ``tensor``'s storages that are not counted yet; return the bytes added."""
        return sum(self._track(storage) for storage in _storages_of(tensor) if storage._cdata not in self._live)

    def _settle(self) -> int:
        """Bring every known storage's count to its size now: growth or frees that no operation
        reported (``untyped_storage().resize_()`` between operations); return the bytes added."""
        added = 0
        for key, ref in list(self._storages.items()):
            storage = ref()
            known = self._live.get(key)
            if storage is not None and known is not None:
                added += self._resize(key, storage, known)
        return added

    def _resize(self, key: int, storage: torch.UntypedStorage, known: int) -> int:
        """Bring a counted storage from ``known`` bytes to its size now; return the change."""
        grown = storage.nbytes() - known
        if grown:
            self._add(key, grown)
        return grown

    def _over_limit(self, func: Any, added: int, anywhere: bool = False) -> torch.OutOfMemoryError | None:
        """The error to raise when the bytes just ``added`` took live memory over the limit
        (``anywhere``: when live memory is over it at all, whoever added it)."""
        limit = self.budget_bytes
        if (added <= 0 and not anywhere) or limit is None or self._current <= limit:
            return None
        self._last_failure = self._current
        return torch.OutOfMemoryError(
            f"CPU out of memory under batchfit's live-tensor limit: {func} tried to allocate {format_bytes(added)} "
            f"with {format_bytes(self._current - added)} of tensors live and a limit of {format_bytes(limit)} "
            f"(DefaultCPUAllocator: can't allocate memory: you tried to allocate {added} bytes)"
        )

    # Meter interface ---------------------------------------------------------------------
    def _storage_bytes(self, storage: torch.UntypedStorage) -> int:
        # Only what this meter saw being created counts (a scalar made by torch.tensor() is not).
        with self._lock:
            return self._live.get(storage._cdata, 0)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        try:
            yield
        finally:
            # Storages that outlive the probe (the model's own) must not call back into it later.
            for finalizer in list(self._finalizers.values()):
                finalizer.detach()
            self._finalizers.clear()

    #: What `notes` says when a scratch-allocating operator ran ({ops}: their names).
    scratch_note = (
        "the steps ran {ops}: CPU kernels allocate scratch memory inside such an operation and free it before it "
        "returns, which the live-tensor meter does not see, so on the CPU the max batch may be a little high "
        "(resnet18: 67 where the allocator's boundary is 66); the safe batch's headroom covers it"
    )

    def notes(self) -> list[str]:
        if not self.scratch_ops:
            return list(self._said)
        ops = ", ".join(sorted({op.overloadpacket.__name__ for op in self.scratch_ops}))
        return [*self._said, self.scratch_note.format(ops=ops)]

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        self._tracking = True
        previous = threading.getprofile()
        threading.setprofile(_ThreadWatch(self, previous))
        try:
            with _DispatchObserver(self):
                yield
        finally:
            threading.setprofile(previous)
            self._tracking = False
            self._settle()

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
            self._largest_request = 0

    def trial_facts(self) -> AllocatorFacts | None:
        """The largest single allocation the trial made (the rest of the facts are a caching allocator's)."""
        with self._lock:
            return AllocatorFacts(largest_request_bytes=self._largest_request or None)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            self._phase = name
            self._phase_peaks[name] = max(self._phase_peaks.get(name, 0), self._current)
        try:
            yield
        except BaseException:
            with self._lock:
                self._phase = None
            raise
        # Memory no operation reported (resized between operations, another thread's) fails the step here.
        error = self._over_limit(f"the {name} phase", self._settle(), anywhere=True)
        with self._lock:
            self._phase = None
        if error is not None:
            try:
                raise error
            finally:
                del error

    def failure_bytes(self, message: str) -> tuple[int | None, int | None]:
        # The meter's own limit knows exactly; a real allocator failure states its request.
        if self._last_failure is not None:
            return self._last_failure, self._last_failure
        return super().failure_bytes(message)


_ATEN = torch.ops.aten
_LIFT_FRESH = _ATEN.lift_fresh.default


#: CPU operators whose kernels allocate scratch memory and free it before they return, unseen by the meter (the
#: oneDNN/im2col convolution buffers): where one ran, a note says the max may be a little high (resnet18: 67, not 66).
SCRATCH_OPERATORS = frozenset(
    {
        _ATEN.convolution.default,
        _ATEN.convolution_backward.default,
        _ATEN._convolution.default,
        _ATEN.mkldnn_convolution.default,
        _ATEN.conv_transpose1d.default,
        _ATEN.conv_transpose2d.input,
        _ATEN.conv_transpose3d.input,
    }
)
#: The operators through which a storage made outside any operation enters a tensor.
_SET_STORAGE = frozenset({_ATEN.set_.source_Storage, _ATEN.set_.source_Storage_storage_offset})


class _DispatchObserver(TorchDispatchMode):
    """Hands every dispatched operation's outputs to a `LiveTensorMeter`.

    ``main``: on the probing thread the observer enforces the limit and is where a deferred
    Ctrl-C surfaces; on a thread started during a step it only counts (the probing thread fails
    the step at its next operation or phase end), and it stops counting once the step is over.
    """

    def __init__(self, meter: LiveTensorMeter, main: bool = True) -> None:
        super().__init__()
        self._meter = meter
        self._main = main

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        meter = self._meter
        if func is _LIFT_FRESH or not meter._tracking:
            # torch.tensor(...) hands its new tensor to lift_fresh, which returns it as is: not an
            # allocation the step made (under FakeTensorMode it returns a fake copy: no more one).
            return out
        # Operators compare as objects: str(func) would cost a string per operation of every step.
        if func in SCRATCH_OPERATORS:
            meter.scratch_ops.add(func)
        added = 0
        if func in _SET_STORAGE and isinstance(out, torch.Tensor):
            # A storage made outside any operation (torch.UntypedStorage, a storage's clone()) enters the
            # step here; by now it is also its input's storage: count it before _observe takes it for that.
            added += meter._adopt(out)
        added += meter._observe(args, kwargs, out)
        if not self._main:
            return out
        error = meter._over_limit(func, added) if added > 0 else None  # most add nothing (views, in-place ops)
        if error is not None:
            # A real allocator never hands out the failing block: drop it before raising, so no
            # frame of the traceback keeps it alive. And drop the error's local name: this frame is
            # in its traceback, and the cycle would keep every tensor of the failed step alive until
            # the garbage collector's next pass (a real allocator's OOM, raised from C++, makes no
            # such cycle; Accelerate's retry loop then ran out of memory again).
            del out
            try:
                raise error
            finally:
                del error
        meter.checkpoint()  # a deferred Ctrl-C surfaces here, between two operations
        return out


class _ThreadWatch:
    """``threading.setprofile`` hook while a step runs: a thread started then gets its own `_DispatchObserver`
    (dispatch modes are per thread) at its first Python call, and the profile function it would have had back."""

    def __init__(self, meter: LiveTensorMeter, previous: Any) -> None:
        self._meter = meter
        self._previous = previous

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        sys.setprofile(self._previous)
        if self._meter._tracking:
            # Never exited: the mode lives on the thread's own stack and dies with it; once the
            # step is over it passes every operation through uncounted.
            _DispatchObserver(self._meter, main=False).__enter__()
        return None


def _storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """A CPU tensor's data storages (`data_storages`), a plain strided one's the short way; none elsewhere."""
    if type(tensor) is torch.Tensor and tensor.layout == torch.strided:
        return [tensor.untyped_storage()] if tensor.is_cpu else []
    return data_storages(tensor) if tensor.device.type == "cpu" else []


#: What an operator's arguments hold besides tensors and lists of them: nothing to count.
_SCALARS = (int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or outputs, as ``tree_leaves`` finds them: aten's lists and
    tuples walked directly (the pytree's walk cost more than the rest of the bookkeeping), others by it."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if type(tree) is not tuple and type(tree) is not list:
        return [] if isinstance(tree, _SCALARS) else [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    found: list[torch.Tensor] = []
    for item in tree:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif not isinstance(item, _SCALARS):
            found += _tensors_in(item)
    return found


def _input_keys(args: tuple, kwargs: dict) -> set[int]:
    """The storages an operation was given: outputs that alias them are not new memory."""
    keys: set[int] = set()
    for leaf in _tensors_in(args) + (_tensors_in(list(kwargs.values())) if kwargs else []):
        with contextlib.suppress(UncountableMemoryError):
            keys.update([storage._cdata for storage in _storages_of(leaf)])
    return keys
