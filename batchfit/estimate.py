"""``batchfit.estimate()``: the answer for a memory size before you own the device.

The same search as :func:`batchfit.find`, over the same trial code (batch, forward, loss,
backward, optimizer step, the optimizer kept between trials), but every tensor is a *fake*
(``torch._subclasses.fake_tensor.FakeTensorMode``): shapes, dtypes and storages without data. The
CPU's live-tensor meter counts the fake storages as it counts real ones, so on the CPU the estimate
is the probe's own measurement, byte for byte, at any size, in seconds and with no memory: the
search traces each candidate size instead of extrapolating from small ones.

How the parts fit:

* :class:`FakeProbe` stands in for :class:`~batchfit.finder.Prober` in
  :func:`~batchfit.finder.search_with`. It swaps fake parameters and buffers into the model's slots
  (tied weights stay tied) and puts the originals back afterwards: the user's tensors are never
  read, copied or moved, so a model on the ``meta`` device works too.
* The target device decides the meter. ``"cpu"``: the live-tensor meter and its limit.
  ``"cuda"``: the same trace fed to a model of the CUDA caching allocator
  (``batchfit.allocator_model``: 512-byte rounding, 2 MiB / 20 MiB segments, cached blocks), the
  budget counting reserved bytes as a real CUDA probe does, with the fixed costs that live beside
  the model (the cuBLAS workspaces, the CUDA context) as stated assumptions. The trace itself runs
  on the CPU: fake CUDA tensors cannot run autograd on a CPU-only build of torch.
* Models that do data-dependent work (``.item()``, ``nonzero``, masks checked on their values) stop
  a fake trace. Then real CPU steps at three small sizes under the live meter give the memory
  lines, and the answer is read off them, marked as extrapolated: never a crash, never a silent
  guess.

Nothing here is timed: a fake step's wall time means nothing, so an estimate has no throughput.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType
from typing import Any

import torch
from torch import nn

from batchfit.backends.cpu import LiveTensorMeter
from batchfit.errors import NothingFitsError
from batchfit.oom import first_line
from batchfit.options import DEFAULT_MAX_BATCH, Options, positive_int
from batchfit.ranks import Solo
from batchfit.result import DeviceInfo, MemoryModel, Result, Trial, TrialKind, Unit
from batchfit.trial import run_trial
from batchfit.units import format_bytes, parse_memory_limit, parse_reserve
from batchfit.workload import Workload, batch_size_of, optimizer_factory, tensor_leaves

__all__ = ["TARGETS", "FakeProbe", "Untraceable", "estimate"]

#: The devices an estimate can be for.
TARGETS = ("cpu", "cuda")

#: Sizes of the real steps a model that cannot be traced on fake tensors falls back to.
FALLBACK_SIZES = (2, 4, 8)


class Untraceable(Exception):
    """The model did something fake tensors cannot do (data-dependent output, an operator with no
    fake implementation): the estimate falls back to real CPU steps."""


def _fake_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses import fake_tensor

    names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException")
    found = tuple(getattr(fake_tensor, name) for name in names if hasattr(fake_tensor, name))
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (*found, GuardOnDataDependentSymNode)


class _Swap:
    """Fake parameters and buffers in the model's slots, the originals put back on exit."""

    def __init__(self, model: nn.Module, mode: Any) -> None:
        self.model = model
        self.mode = mode
        self._saved: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]] = []

    def __enter__(self) -> _Swap:
        made: dict[int, Any] = {}  # one fake per original tensor: tied weights stay tied
        with self.mode:
            for module in self.model.modules():
                self._saved.append((module, dict(module._parameters), dict(module._buffers)))
                for name, param in module._parameters.items():
                    if param is not None:
                        if id(param) not in made:
                            made[id(param)] = nn.Parameter(_fake_like(param), requires_grad=param.requires_grad)
                        module._parameters[name] = made[id(param)]
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        if id(buffer) not in made:
                            made[id(buffer)] = _fake_like(buffer)
                        module._buffers[name] = made[id(buffer)]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for module, parameters, buffers in self._saved:
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)
        self._saved.clear()


def _fake_like(tensor: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor of ``tensor``'s shape and dtype (made inside the fake mode)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


def _fake_sample(sample: Any) -> Any:
    from batchfit.workload import _map_tensors

    return _map_tensors(sample, lambda t: _fake_like(t).requires_grad_(False))


class _FakeWorkload(Workload):
    """A workload without ``GradScaler``: its inf check reads the gradients' values (``.item()``),
    which fake tensors do not have; its memory (a few scalars) does not matter."""

    def grad_scaler(self, init_scale: float | None = None) -> None:  # type: ignore[override]
        return None


class FakeProbe:
    """Trials on fake tensors for :func:`~batchfit.finder.search_with` (see the module docs)."""

    def __init__(self, model: nn.Module, sample: Any, options: Options, target: str, budget_bytes: int) -> None:
        self.options = options
        self.mode = options.mode
        self.target = target
        self.ranks = Solo()
        self._model = getattr(model, "_orig_mod", model)  # a compiled model is traced eagerly
        self._sample = sample
        self._sample_size = batch_size_of(sample) if sample is not None else None
        self.budget_bytes: int | None = budget_bytes
        self.limit_bytes: int | None = budget_bytes
        self.limit_source = "memory"
        self.reserve_bytes = 0
        self.counts: Unit = "reserved" if target == "cuda" else "allocated"
        self.device_info = DeviceInfo(type=target, name=f"estimate for {target}", total_bytes=None)
        self.notes: list[str] = []
        self.optimizer_state_bytes = 0
        self.meter: LiveTensorMeter | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._stack: contextlib.ExitStack | None = None
        self._workload: Workload | None = None
        self._fake_mode: Any = None

    def __enter__(self) -> FakeProbe:
        from torch._subclasses.fake_tensor import FakeTensorMode

        stack = contextlib.ExitStack()
        try:
            rng = torch.random.get_rng_state()
            stack.callback(torch.random.set_rng_state, rng)
            self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            stack.enter_context(_Swap(self._model, self._fake_mode))
            with self._fake_mode:
                sample = _fake_sample(self._sample) if self._sample is not None else None
            self._workload = _FakeWorkload(
                model=self._model,
                device=torch.device("cpu"),
                mode=self.mode,
                sample=sample,
                sample_size=self._sample_size,
                make_batch=self.options.make_batch,
                loss_fn=self.options.loss_fn,
                step_fn=self.options.step_fn,
                new_optimizer=optimizer_factory(self.options.optimizer),
                amp=self.options.amp,
            )
            held = [*self._model.parameters(), *self._model.buffers()] + [t for _, t in tensor_leaves(sample, "s")]
            self.meter = _meter_for(self.target, self.budget_bytes, held)
            stack.enter_context(self.meter.active())
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._optimizer = None
        self._workload = None
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def trial(
        self, batch_size: int, steps: int | None = None, kind: TrialKind = "search", fresh_optimizer: bool = False
    ) -> Trial:
        """A fake trial at ``batch_size``, the optimizer kept as :meth:`Prober.trial` keeps it."""
        assert self._workload is not None and self.meter is not None, "FakeProbe.trial() needs 'with FakeProbe(...)'"
        batch_size = positive_int("batch_size", batch_size)
        if fresh_optimizer:
            self._optimizer = None
            self.meter.release()
        if steps is None:
            steps = self.options.steps_per_trial or (1 if self.mode != "train" or self._optimizer is not None else 2)
        kept, self._optimizer = self._optimizer, None
        try:
            with self._fake_mode:
                run = run_trial(self._workload, self.meter, batch_size, steps, kind, None, kept)
        except _fake_errors() as exc:
            raise Untraceable(f"{type(exc).__name__}: {first_line(exc)}") from exc
        del kept
        self._optimizer = run.optimizer
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, run.optimizer_state_bytes)
        # A fake step's wall time says nothing about a real one.
        return replace(run.trial, step_time_s=None, samples_per_s=None, step_times_s=())

    def memory_model(self, trials: list[Trial]) -> MemoryModel | None:
        weights, trainable = _parameter_bytes(self._model)
        grads = trainable if self.mode == "train" else 0
        return MemoryModel.fit(trials, weights, grads, self.optimizer_state_bytes, unit=self.counts)

    def fixed_advice(self) -> str | None:
        from batchfit.finder import fixed_memory_advice

        weights, trainable = _parameter_bytes(self._model)
        return fixed_memory_advice(weights, trainable, self.mode, self.options.optimizer, self.budget_bytes)

    def ranks_notes(self) -> list[str]:
        return []


def _parameter_bytes(model: nn.Module) -> tuple[int, int]:
    params = list(dict.fromkeys(model.parameters()))
    weights = sum(p.numel() * p.element_size() for p in params)
    return weights, sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def _meter_for(target: str, budget_bytes: int, held: list[torch.Tensor]) -> LiveTensorMeter:
    if target == "cuda":
        from batchfit.backends.simulated import SimulatedCudaMeter

        return SimulatedCudaMeter(budget_bytes, held)
    return LiveTensorMeter(budget_bytes, None, tensors=held)


def estimate(
    model: nn.Module,
    sample: Any = None,
    *,
    memory: int | str,
    device: str = "cpu",
    reserve: int | str | None = None,
    make_batch: Callable[[int], Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    step_fn: Callable[[nn.Module, Any], Any] | None = None,
    optimizer: Any = None,
    amp: str | None = None,
    mode: str = "train",
    headroom: float = 0.10,
    init_batch: int | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    multiple_of: int = 1,
    strategy: str = "interpolate",
    callback: Callable[[Trial], None] | None = None,
) -> Result:
    """Estimate :func:`batchfit.find`'s answer for a device with ``memory`` bytes, without it.

    Runs the probe's search over fake trials (see the module docs): no device, no memory, seconds.
    The :class:`~batchfit.result.Result` has ``estimated=True`` and its ``assumptions`` listed;
    ``str()`` says "estimate". No throughput (nothing real is timed).

    Args:
        memory: the device's memory: bytes or a size (``"80GiB"``, ``"24GB"``).
        device: ``"cpu"`` (the live-tensor meter's count, equal to what ``find()`` measures on the
            CPU under ``memory_limit=memory``) or ``"cuda"`` (the caching allocator's reserved
            bytes, modelled; see the assumptions in the result).
        reserve: taken off ``memory`` for what lives outside the allocator. Default: nothing on
            the CPU; on CUDA 512 MiB for the CUDA context (an assumption, stated).
        The rest: as :func:`batchfit.find`.

    Raises:
        NothingFitsError: not even ``init_batch`` fits the memory.
        TypeError, ValueError: bad arguments.
        A model that cannot be traced on fake tensors is not an error: see the module docs.
    """
    started = time.monotonic()
    if device not in TARGETS:
        raise ValueError(f"device must be one of {', '.join(map(repr, TARGETS))} for an estimate, got {device!r}")
    if isinstance(memory, float) or not isinstance(memory, (int, str)):
        raise TypeError(f"memory must be bytes or a size such as '80GiB', got {type(memory).__name__} {memory!r}")
    total = parse_memory_limit(memory, None)
    assumptions = _assumptions(device, amp)
    if reserve is None:
        kept_aside = CUDA_CONTEXT_BYTES if device == "cuda" else 0
    else:
        parsed = parse_reserve(reserve)
        if parsed == "auto":
            raise ValueError("reserve='auto' measures a real device: an estimate takes a size")
        kept_aside = int(parsed)
    if kept_aside:
        assumptions.append(f"{format_bytes(kept_aside)} of the {format_bytes(total)} are outside the allocator")
    budget = total - kept_aside
    if budget <= 0:
        raise ValueError(f"reserve {format_bytes(kept_aside)} leaves nothing of memory {format_bytes(total)}")
    options = Options(
        make_batch=make_batch,
        loss_fn=loss_fn,
        step_fn=step_fn,
        optimizer=optimizer,
        amp=amp,  # type: ignore[arg-type]
        mode=mode,  # type: ignore[arg-type]
        device="cpu",
        memory_limit=budget,
        headroom=headroom,
        init_batch=init_batch,
        max_batch=max_batch,
        multiple_of=multiple_of,
        strategy=strategy,
        distributed=False,
    )
    _check_input(model, sample, options)
    from batchfit.finder import search_with

    try:
        probe = FakeProbe(model, sample, options, device, budget)
        result = search_with(probe, options, started, callback=callback)
    except Untraceable as untraceable:
        result = _extrapolate(model, sample, options, budget, untraceable, started)
        assumptions.append(
            f"extrapolated from real CPU steps at batch {', '.join(map(str, FALLBACK_SIZES))}: the model does "
            f"data-dependent work that fake tensors cannot trace ({untraceable})"
        )
    return replace(
        result,
        device=replace(result.device, name=f"estimate for {device}", total_bytes=total),
        estimated=True,
        assumptions=tuple(assumptions),
        elapsed_s=time.monotonic() - started,
    )


#: What the CUDA context takes outside the caching allocator when nobody says (an assumption).
CUDA_CONTEXT_BYTES = 512 * 2**20


def _assumptions(device: str, amp: str | None) -> list[str]:
    said = ["traced on fake tensors: no step ran, no memory was used; nothing is timed, so no throughput"]
    if device == "cuda":
        from batchfit.backends.simulated import CUBLAS_HANDLES, CUBLAS_WORKSPACE_BYTES

        said += [
            "CUDA memory is modelled, not measured: the caching allocator's rounding (512 B) and segments "
            "(2 MiB for requests up to 1 MiB, 20 MiB up to 10 MiB, larger ones rounded to 2 MiB), the budget "
            "counting reserved bytes",
            f"cuBLAS workspaces: {CUBLAS_HANDLES} x {format_bytes(CUBLAS_WORKSPACE_BYTES)} (forward and backward "
            "threads, sm90 sizes) held by the allocator",
            "the step's operators and their saved tensors are the CPU's (kernels that keep other tensors on "
            "CUDA, such as fused attention's, are not modelled)",
        ]
        if amp is not None:
            said.append(f"amp {amp}: the CPU's autocast casting rules, which cast fewer operators than CUDA's")
    return said


def _check_input(model: nn.Module, sample: Any, options: Options) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if (sample is None) == (options.make_batch is None):
        raise TypeError("pass exactly one of sample= (one batch; dim 0 is the batch) or make_batch=")


def _extrapolate(
    model: nn.Module, sample: Any, options: Options, budget: int, why: Untraceable, started: float
) -> Result:
    """Real CPU steps at :data:`FALLBACK_SIZES` (no limit), their memory lines, the answer read
    off them: the fallback for models fake tensors cannot trace."""
    from batchfit.finder import Prober

    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ValueError(
            f"the model does data-dependent work that fake tensors cannot trace ({why}), and its weights are on the "
            "meta device, so no real step can run instead: build it with real weights on the CPU"
        ) from None
    real = replace(options, memory_limit=None, steps_per_trial=2, verify_steps=0)
    trials: list[Trial] = []
    with Prober(model, sample, options=real) as prober:
        for size in FALLBACK_SIZES:
            trials.append(prober.trial(size, steps=2, fresh_optimizer=True))
        memory = prober.memory_model(trials)
        device_info = prober.device_info
    grid = options.grid()
    if memory is None:
        raise NothingFitsError(FALLBACK_SIZES[0], None, budget, None, "no two sizes ran to fit memory lines")
    largest = grid.floor(memory.largest_batch_within(budget, ceiling=grid.top))
    if largest < grid.init:
        raise NothingFitsError(grid.init, memory.predict(grid.init), budget, None, None, None)
    safe = max(grid.init, grid.floor(memory.largest_batch_within(budget * (1 - options.headroom), ceiling=largest)))
    from batchfit.finder import _settings_of

    return Result(
        max_batch=largest,
        safe_batch=safe,
        best_throughput_batch=largest,
        budget_bytes=budget,
        boundary_reached=False,
        stop_reason="stopped",
        non_monotone=False,
        safe_verified=False,
        trials=tuple(replace(t, step_time_s=None, samples_per_s=None, step_times_s=()) for t in trials),
        memory=memory,
        device=device_info,
        settings=_settings_of(options, budget, "memory", 0, "extrapolate"),
        elapsed_s=time.monotonic() - started,
        torch_version=torch.__version__,
        batchfit_version=_version(),
        notes=(
            f"max and safe batch are read off the memory line {format_bytes(memory.fixed_bytes)} + "
            f"{format_bytes(memory.per_sample_bytes)} x batch fitted to real CPU steps at "
            f"{', '.join(map(str, FALLBACK_SIZES))}: no size near them ran",
        ),
        budget_counts="allocated",
    )


def _version() -> str:
    from batchfit.version import __version__

    return __version__
