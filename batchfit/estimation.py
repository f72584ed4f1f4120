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
* The target device decides the meter (``batchfit.backends.simulated.ESTIMATE_TARGETS``). The
  CPU: the live-tensor meter and its limit. CUDA: the same trace fed to a model of its caching allocator
  (``batchfit.allocator_model``: 512-byte rounding, 2 MiB / 20 MiB segments, cached blocks), the
  budget counting reserved bytes as a real CUDA probe does, with the fixed costs that live beside
  the model (the cuBLAS workspaces, the CUDA context) as stated assumptions. The trace itself runs
  on the CPU: fake CUDA tensors cannot run autograd on a CPU-only build of torch.
* Models that do data-dependent work (``.item()``, ``nonzero``, masks checked on their values) stop
  a fake trace. Then a real probe runs on the CPU under the live meter, capped at
  :data:`FALLBACK_CAP` of live tensors: within the cap it is the answer; above it the answer is
  read off the real trials' memory lines, marked as extrapolated: never a crash, never a silent
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
from batchfit.backends.simulated import ESTIMATE_TARGETS, EstimateTarget, estimate_target
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
TARGETS = tuple(ESTIMATE_TARGETS)

#: Live tensor bytes the real CPU steps of the fallback may use (see :func:`_extrapolate`).
FALLBACK_CAP = 256 * 2**20


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

    def __init__(
        self, model: nn.Module, sample: Any, options: Options, target: EstimateTarget, budget_bytes: int
    ) -> None:
        self.options = options
        self.mode = options.mode
        self.target = target
        self.ranks = Solo()
        self._compiled = model
        self._model = getattr(model, "_orig_mod", model)  # a compiled model is traced eagerly
        self._sample = sample
        self._sample_size = batch_size_of(sample) if sample is not None else None
        self.budget_bytes: int | None = budget_bytes
        self.limit_bytes: int | None = budget_bytes
        self.limit_source = "memory"
        self.reserve_bytes = 0
        self.counts: Unit = target.counts
        self.device_info = DeviceInfo(type=target.name, name=f"estimate for {target.name}", total_bytes=None)
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
            # As a probe does: train() for training, eval() for inference, the flags put back after.
            flags = [(module, module.training) for module in self._model.modules()]
            stack.callback(lambda: [setattr(module, "training", flag) for module, flag in flags])
            self._model.train(self.mode == "train")
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
            budget = self.budget_bytes
            assert budget is not None
            held = [*self._model.parameters(), *self._model.buffers()] + [t for _, t in tensor_leaves(sample, "s")]
            self.meter = self.target.make_meter(budget, held)
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
            raise Untraceable(first_line(exc)) from exc
        del kept
        self._optimizer = run.optimizer
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, run.optimizer_state_bytes)
        # A fake step's wall time says nothing about a real one.
        return replace(run.trial, step_time_s=None, samples_per_s=None, step_times_s=())

    def memory_model(self, trials: list[Trial]) -> MemoryModel | None:
        from batchfit.finder import fit_memory, parameter_bytes

        weights, trainable = parameter_bytes(self._model)
        return fit_memory(trials, weights, trainable, self.mode, self.optimizer_state_bytes, self.counts)

    def fixed_advice(self) -> str | None:
        from batchfit.finder import fixed_memory_advice, parameter_bytes

        weights, trainable = parameter_bytes(self._model)
        return fixed_memory_advice(weights, trainable, self.mode, self.options.optimizer, self.budget_bytes)

    def ranks_notes(self) -> list[str]:
        return []

    def compile_notes(self, trials: list[Trial]) -> list[str]:
        from batchfit.compiled import compiled_info

        info = compiled_info(self._compiled)
        if info is None:
            return []
        return [
            "the torch.compile'd model was traced as its eager module (fake tensors cannot run compiled code); "
            "compiled code can use less memory (fused kernels keep fewer intermediates)"
            + ("; it was compiled with dynamic=False, which recompiles per batch size" if info.dynamic is False else "")
        ]


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
        device: what to estimate for (:data:`TARGETS`): the CPU (the live-tensor meter's count,
            equal to what ``find()`` measures there under ``memory_limit=memory``; the default)
            or CUDA (the caching allocator's reserved bytes, modelled; see the assumptions).
        reserve: taken off ``memory`` for what lives outside the allocator. Default: nothing on
            the CPU; on CUDA 512 MiB for the CUDA context (an assumption, stated).
        The rest: as :func:`batchfit.find`.

    Raises:
        NothingFitsError: not even ``init_batch`` fits the memory.
        TypeError, ValueError: bad arguments.
        A model that cannot be traced on fake tensors is not an error: see the module docs.
    """
    started = time.monotonic()
    target = estimate_target(device)
    if isinstance(memory, float) or not isinstance(memory, (int, str)):
        raise TypeError(f"memory must be bytes or a size such as '80GiB', got {type(memory).__name__} {memory!r}")
    total = parse_memory_limit(memory, None)
    assumptions = _assumptions(target, amp)
    if reserve is None:
        kept_aside = target.outside_allocator_bytes
    elif reserve in (0, "0"):
        kept_aside = 0  # nothing outside the allocator: the whole memory is the budget
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
    from batchfit.finder import check_work, search_with

    check_work(model, sample, options)

    try:
        probe = FakeProbe(model, sample, options, target, budget)
        result = search_with(probe, options, started, callback=callback)
    except Untraceable as untraceable:
        result, said = _extrapolate(model, sample, options, budget, untraceable, started)
        assumptions.append(said)
    return replace(
        result,
        device=replace(result.device, name=f"estimate for {device}", total_bytes=total),
        estimated=True,
        assumptions=tuple(assumptions),
        elapsed_s=time.monotonic() - started,
    )


def _assumptions(target: EstimateTarget, amp: str | None) -> list[str]:
    said = ["traced on fake tensors: no step ran, no memory was used; nothing is timed, so no throughput"]
    said += target.assumptions
    if amp is not None and target.amp_assumption:
        said.append(f"amp {amp}: {target.amp_assumption}")
    return said


def _extrapolate(
    model: nn.Module, sample: Any, options: Options, budget: int, why: Untraceable, started: float
) -> tuple[Result, str]:
    """The fallback for models fake tensors cannot trace: a real probe on the CPU under
    ``min(budget, FALLBACK_CAP)`` of live tensors. Under the cap that *is* the answer (for the
    CPU); above it, the answer is read off the memory lines of the real trials, which reach sizes
    where the per-sample bytes show (a few small sizes would see only the fixed costs). Returns
    the result and the assumption that says which it was."""
    from batchfit.finder import find_with

    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ValueError(
            f"the model does data-dependent work that fake tensors cannot trace ({why}), and its weights are on the "
            "meta device, so no real step can run instead: build it with real weights on the CPU"
        ) from None
    cap = min(budget, FALLBACK_CAP)
    real = find_with(model, sample, replace(options, memory_limit=cap, distributed=False))
    trials = tuple(replace(t, step_time_s=None, samples_per_s=None, step_times_s=()) for t in real.trials)
    untimed = replace(real, trials=trials, throughput=None)
    if cap == budget:
        return untimed, (
            f"ran real CPU steps under the live-tensor meter instead: the model does data-dependent work that fake "
            f"tensors cannot trace ({why})"
        )
    memory = real.memory
    if memory is None:
        raise NothingFitsError(real.max_batch, None, budget, None, "fewer than two sizes fitted to fit memory lines")
    grid = options.grid()
    largest = max(real.max_batch, grid.floor(memory.largest_batch_within(budget, ceiling=grid.top)))
    safe = max(grid.init, grid.floor(memory.largest_batch_within(budget * (1 - options.headroom), ceiling=largest)))
    sizes = sorted({t.batch_size for t in real.trials if t.fits})
    result = replace(
        untimed,
        max_batch=largest,
        safe_batch=safe,
        best_throughput_batch=largest,
        budget_bytes=budget,
        boundary_reached=False,
        stop_reason="stopped",
        safe_verified=False,
        notes=(
            *real.notes,
            f"max and safe batch are read off the memory line {format_bytes(memory.fixed_bytes)} + "
            f"{format_bytes(memory.per_sample_bytes)} x batch fitted to real CPU steps up to batch {sizes[-1]} "
            f"(under {format_bytes(cap)}): no size near the answer ran",
        ),
    )
    return result, (
        f"extrapolated from real CPU steps at batch {', '.join(map(str, sizes))} (live tensors up to "
        f"{format_bytes(cap)}): the model does data-dependent work that fake tensors cannot trace ({why})"
    )


def _version() -> str:
    from batchfit.version import __version__

    return __version__
