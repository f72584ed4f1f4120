"""Fake trials: the probe's steps on fake tensors, counted as the target device would count them.

The same search as [`batchfit.find`][batchfit.find], over the same trial code (batch, forward, loss,
backward, optimizer step, the optimizer kept between trials), but every tensor is a *fake*
(``torch._subclasses.fake_tensor.FakeTensorMode``): shapes, dtypes and storages without data. The
CPU's live-tensor meter counts the fake storages as it counts real ones, so on the CPU the estimate
is the probe's own measurement, byte for byte, at any size, in seconds and with no memory: the
search traces each candidate size instead of extrapolating from small ones.

How the parts fit:

* `FakeProbe` stands in for [`Prober`][batchfit.Prober] in
  `search_with`. It swaps fake parameters and buffers into the model's slots
  (tied weights stay tied) and puts the originals back afterwards: the user's tensors are never
  read, copied or moved, so a model on the ``meta`` device works too. A model sharded with FSDP2
  is made fake in place instead, in a process of its own (`batchfit.estimation.fake_ranks`).
* The target device decides the meter (``batchfit.backends.simulated.ESTIMATE_TARGETS``). The
  CPU: the live-tensor meter and its limit. CUDA: the same trace fed to a model of its caching allocator
  (``batchfit.backends.allocator_model``: 512-byte rounding, 2 MiB / 20 MiB segments, cached blocks), the
  budget counting reserved bytes as a real CUDA probe does, with the fixed costs that live beside
  the model (the cuBLAS workspaces, the CUDA context) as stated assumptions. The trace itself runs
  on the CPU: fake CUDA tensors cannot run autograd on a CPU-only build of torch. What torch decides
  by the device, the trace decides as the target's would: an optimizer that leaves ``foreach`` to
  torch steps with the foreach implementation on a GPU (`foreach_as_on`), not the CPU's loop.
* Under a modelled allocator (CUDA, ROCm) the trials are *replayed* (`batchfit.estimation.replay`):
  one step is traced at two batch sizes and a forward at a third, and each trial, kept optimizer or
  from scratch, feeds the recorded storages (their bytes affine in the batch size) to the meter in
  the traced order: the trials a trace gives, in milliseconds each. A model the recording cannot
  predict (a path chosen by the batch size, bytes not affine in it) has every trial traced.
* Models that do data-dependent work (``.item()``, ``nonzero``, masks checked on their values) stop
  a fake trace. Then a real probe runs on the CPU under the live meter, capped at
  `FALLBACK_CAP` of live tensors: within the cap it is the answer; above it the answer is
  read off the real trials' memory lines, marked as extrapolated: never a crash, never a silent
  guess.

Nothing here is timed: a fake step's wall time means nothing, so an estimate has no throughput.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from batchfit.backends import EstimateTarget, LiveTensorMeter
from batchfit.distributed import Solo
from batchfit.errors import first_line
from batchfit.estimation.replay import Replay, ReplayState, record
from batchfit.interrupts import InterruptGuard
from batchfit.probe import Options
from batchfit.probe.batches import batch_size_of, map_tensors, tensor_leaves
from batchfit.probe.checks import fit_memory, fixed_memory_advice, parameter_bytes
from batchfit.probe.compiled import compiled_info
from batchfit.probe.runner import Findings, GroupAnswer, Settled, Setup, Traits, TrialRequest, opened
from batchfit.probe.trial import run_trial
from batchfit.probe.workload import Workload, optimizer_factory
from batchfit.report import DeviceInfo, SizedOn, Trial, TrialKind, Unit
from batchfit.units import positive_int

__all__ = ["FakeProbe", "Untraceable", "foreach_as_on"]


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
    """Fake parameters and buffers in the model's slots, the originals put back on exit.

    Every slot is saved before the first is touched, and a swap cut short puts back what it
    swapped: the user's model never keeps a fake tensor, whatever interrupts the swap."""

    def __init__(self, model: nn.Module, mode: Any) -> None:
        self.model = model
        self.mode = mode
        self._saved: list[tuple[nn.Module, dict[str, Any], dict[str, Any]]] = []
        #: The fake standing in for each original tensor, by ``id`` (tied weights share one).
        self.fakes: dict[int, Any] = {}

    def __enter__(self) -> _Swap:
        self._saved = [(module, dict(module._parameters), dict(module._buffers)) for module in self.model.modules()]
        made = self.fakes
        try:
            with self.mode:
                for module, parameters, buffers in self._saved:
                    for name, param in parameters.items():
                        if param is not None:
                            if id(param) not in made:
                                made[id(param)] = nn.Parameter(_fake_like(param), requires_grad=param.requires_grad)
                            module._parameters[name] = made[id(param)]
                    for name, buffer in buffers.items():
                        if buffer is not None:
                            if id(buffer) not in made:
                                made[id(buffer)] = _fake_like(buffer)
                            module._buffers[name] = made[id(buffer)]
        except BaseException:
            self.__exit__()
            raise
        return self

    def fake_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The fake in ``tensor``'s slot (``tensor`` itself when it is not the model's)."""
        return self.fakes.get(id(tensor), tensor)

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
    return map_tensors(sample, lambda t: _fake_like(t).requires_grad_(False))


class _FakeWorkload(Workload):
    """A workload without ``GradScaler``: its inf check reads the gradients' values (``.item()``),
    which fake tensors do not have; its memory (a few scalars) does not matter."""

    def grad_scaler(self, init_scale: float | None = None) -> None:  # type: ignore[override]
        return None


#: Builds a fresh optimizer over the trainable parameters (``batchfit.probe.optimizer_factory``'s kind).
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def foreach_as_on(device_type: str, factory: OptimizerFactory, switched: set[str]) -> OptimizerFactory:
    """``factory``, its optimizers stepping as torch's would on ``device_type`` (names added to ``switched``).

    torch's optimizers take ``foreach=None`` to mean "decide by the parameters": the foreach
    implementation when every one is on a device with foreach kernels (CUDA, ROCm's too), the
    for-loop on the CPU (``torch.optim.optimizer._default_to_fused_or_foreach``). A fake trace runs
    on the CPU, so it would step the loop, whose transients are one parameter's; a foreach step
    keeps one intermediate per parameter live at once (AdamW's ``exp_avg_sq.sqrt()`` list: the
    trainable weights' size again, +474 MiB on GPT-2-small). So where the target would resolve
    ``foreach=None`` to True, the groups that leave it to torch get True, as they would there;
    ``foreach=False``, ``fused=True``, ``differentiable=True`` and Adam's exception (a tensor ``lr``
    without ``capturable``) are left as torch leaves them. ``fused=None`` is not defaulted to True on
    CUDA by torch (2.13 passes ``use_fused=False``), so neither is it here. Only torch's own
    optimizers are changed: another class's ``foreach`` may mean something else.
    """
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    if device_type not in _get_foreach_kernels_supported_devices():
        return factory

    def made(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = factory(params)
        if not type(optimizer).__module__.startswith("torch.optim."):
            return optimizer
        for group in optimizer.param_groups:
            if group.get("foreach", False) is not None or group.get("fused") or group.get("differentiable"):
                continue
            if isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"):
                continue
            group["foreach"] = True
            switched.add(type(optimizer).__name__)
        if optimizer.defaults.get("foreach", False) is None:
            optimizer.defaults["foreach"] = True  # a group added later steps as these do
        return optimizer

    return made


class FakeProbe:
    """Trials on fake tensors for `search_with` (see the module docs).

    ``fake_mode``: the ``FakeTensorMode`` the model and ``sample`` are already fake under (a model
    sharded with FSDP2, made fake in place: `batchfit.estimation.fake_ranks`). Then nothing is
    swapped (a parameter is a ``DTensor`` whose shard FSDP owns) and every trial is traced.
    """

    def __init__(
        self,
        model: nn.Module,
        sample: Any,
        options: Options,
        target: EstimateTarget,
        budget_bytes: int,
        fake_mode: Any = None,
    ) -> None:
        self.options = options
        #: The mode the model and sample were built under (already fake: nothing is swapped), if any.
        self._built_fake = fake_mode
        self.mode = options.mode
        self.target = target
        self.ranks = Solo()
        self._compiled = model
        self._model = getattr(model, "_orig_mod", model)  # a compiled model is traced eagerly
        self._sample = sample
        self._sample_size = batch_size_of(sample) if sample is not None else None
        self.budget_bytes: int | None = budget_bytes
        self.limit_bytes: int | None = budget_bytes
        self.limit_source = "memory_limit"  # the budget line names it as find() does
        self.reserve_bytes = 0
        self.counts: Unit = target.counts
        self.device_info = DeviceInfo(type=target.device_type, name=f"estimate for {target.name}", total_bytes=None)
        self.notes: list[str] = []
        #: Which batch of real data the sizes are built from (set by ``estimate``, as ``Prober.sized_on``).
        self.sized_on: SizedOn | None = None
        #: The optimizers whose ``foreach=None`` the trace resolved as the target would (`foreach_as_on`).
        self.foreach_switched: set[str] = set()
        self.optimizer_state_bytes = 0
        self.meter: LiveTensorMeter | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._stack: contextlib.ExitStack | None = None
        self._workload: Workload | None = None
        self._fake_mode: Any = None
        #: The replay's templates once recorded (`batchfit.estimation.replay`), or why there are none.
        self._replay: Replay | str | None = None
        self._replay_state = ReplayState()
        self._held: list[torch.Tensor] = []
        #: Ctrl-C deferred to safe points and never lost, the restore never cut short: as find()'s.
        self._interrupts = InterruptGuard(exits=(FakeProbe.close, FakeProbe._undo, opened.__exit__))

    def open(self) -> Setup:
        """The model swapped for fake tensors (or taken as built fake), its flags set, the meter on.
        A fake step's wall time says nothing about a real one: no size is timed after the search."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        self._interrupts.__enter__()
        stack = contextlib.ExitStack()
        try:
            with self._interrupts.critical():  # the model is swapped whole, or not at all
                rng = torch.random.get_rng_state()
                stack.callback(torch.random.set_rng_state, rng)
                if self._built_fake is not None:
                    self._fake_mode, parameter_of = self._built_fake, None
                else:
                    self._fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
                    parameter_of = stack.enter_context(_Swap(self._model, self._fake_mode)).fake_of
                # As a probe does: train() for training, eval() for inference, the flags put back after.
                flags = [(module, module.training) for module in self._model.modules()]
                stack.callback(lambda: [setattr(module, "training", flag) for module, flag in flags])
                self._model.train(self.mode == "train")
            if self._built_fake is not None:
                sample = self._sample
            else:
                with self._fake_mode:
                    sample = _fake_sample(self._sample) if self._sample is not None else None
            self._workload = _FakeWorkload(
                model=self._model,
                device=torch.device("cpu"),
                sample=sample,
                sample_size=self._sample_size,
                new_optimizer=foreach_as_on(
                    self.target.device_type,
                    optimizer_factory(self.options.optimizer, parameter_of=parameter_of),
                    self.foreach_switched,
                ),
                **Workload.settings_of(self.options),
            )
            budget = self.budget_bytes
            assert budget is not None
            held = [*self._model.parameters(), *self._model.buffers()] + [t for _, t in tensor_leaves(sample, "s")]
            self._held, self._replay, self._replay_state = held, None, ReplayState()  # recorded anew for this meter
            self.meter = self.target.make_meter(budget, held)
            self.meter.interrupts = self._interrupts
            stack.enter_context(self.meter.active())
        except BaseException as exc:
            self._stack = stack
            self._interrupts.finish(self._undo, exc)
            raise
        self._stack = stack
        traits = Traits(layout_carries=self.meter.layout_carries)
        facts = (self.budget_bytes, self.counts, self.device_info, self.ranks, self.limit_bytes, self.limit_source)
        return Setup(*facts, self.reserve_bytes, traits, self.sized_on, (*self.notes,))

    def close(self, trials: Sequence[Trial], answer: GroupAnswer | None, exc: BaseException | None) -> Findings:
        """The model's own tensors, flags and the RNG back; what compilation and the meter have to say."""
        self._interrupts.finish(self._undo, exc)
        if exc is not None:
            weights, trainable = parameter_bytes(self._model)
            options, budget = self.options, self.budget_bytes
            return Findings(fixed_advice=fixed_memory_advice(weights, trainable, self.mode, options.optimizer, budget))
        return Findings((*self._compile_notes(), *(self.meter.notes() if self.meter is not None else [])))

    def _undo(self) -> None:
        """The model's own tensors, flags and the RNG back (no Ctrl-C can cut it short)."""
        self._optimizer = None
        self._workload = None
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def run(self, request: TrialRequest) -> Trial:
        """A fake trial, the optimizer kept and the cap lowered as `Prober.run` does."""
        assert self._workload is not None and self.meter is not None, "FakeProbe.run() needs an open probe (`opened`)"
        steps, kind, cap_bytes = request.steps, request.kind, request.cap_bytes
        batch_size = positive_int("batch_size", request.batch_size)
        fresh_optimizer = request.fresh_optimizer or request.from_scratch  # the allocator model keeps no workspace
        if self._replay is None:
            self._replay = self._record()
            if isinstance(self._replay, Replay):
                self.meter.scratch_ops.update(self._replay.scratch_ops)  # the note the traced trials would leave
        if isinstance(self._replay, Replay):
            return self._replayed(batch_size, steps, kind, fresh_optimizer, cap_bytes)
        if fresh_optimizer:
            self._optimizer = None
            self.meter.release()
        if steps is None:
            steps = self.options.steps_per_trial or (1 if self.mode != "train" or self._optimizer is not None else 2)
        self._interrupts.check()
        kept, self._optimizer = self._optimizer, None
        try:
            with self._fake_mode, self.meter.capped(cap_bytes):
                run = run_trial(self._workload, self.meter, batch_size, steps, kind, None, kept)
        except _fake_errors() as exc:
            raise Untraceable(first_line(exc)) from exc
        del kept
        self._interrupts.check()
        self._optimizer = run.optimizer
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, run.optimizer_state_bytes)
        # A fake step's wall time says nothing about a real one.
        return replace(run.trial, step_time_s=None, samples_per_s=None, step_times_s=())

    def _replayed(
        self, batch_size: int, steps: int | None, kind: TrialKind, fresh_optimizer: bool, cap_bytes: int | None
    ) -> Trial:
        """`trial` from the recorded templates (`batchfit.estimation.replay`): the same calls on the meter."""
        assert isinstance(self._replay, Replay) and self.meter is not None
        state = self._replay_state
        if fresh_optimizer:
            Replay.drop_state(self.meter, state)
            self.meter.release(target_bytes=self.meter.allocated_bytes())  # the cache emptied; nothing to collect
        if steps is None:
            steps = self.options.steps_per_trial or (1 if state.warm else 2)
        self._interrupts.check()
        with self.meter.capped(cap_bytes):
            trial, state_bytes = self._replay.trial(self.meter, state, batch_size, steps, kind)
        self._interrupts.check()
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, state_bytes)
        return trial

    def _record(self) -> Replay | str:
        """The templates a replay needs, from two traced steps and a forward (`record`), or why there are none."""
        if self.mode != "train" or self.meter is None or not self.meter.layout_carries:
            return "only a training step under a modelled allocator is replayed"
        if self._built_fake is not None:
            return "a model built fake (a sharded one) is traced trial by trial"
        assert self._workload is not None
        if self.meter.reserved_bytes() >= (self.budget_bytes or 0):
            return "the fixed memory alone fills the budget: the first trial fails at once, traced"
        grid = self.options.grid()
        sizes = (grid.init, grid.init + grid.multiple_of, grid.init + 7 * grid.multiple_of)
        with self._fake_mode:
            replay, left = record(self._workload, self._held, sizes, self._interrupts)
        for storage in left:  # kept by the model from its first step: counted as the traced trials would
            self.meter._track(storage)
        return replay

    def settle(self, trials: Sequence[Trial]) -> Settled:
        """The budget (an estimate's reserve is a given size, never measured again) and the memory equation."""
        weights, trainable = parameter_bytes(self._model)
        state, budget = self.optimizer_state_bytes, self.budget_bytes
        memory = fit_memory(list(trials), weights, trainable, self.mode, state, self.counts, budget)
        return Settled(budget, self.limit_bytes, self.limit_source, self.reserve_bytes, memory)

    def _compile_notes(self) -> list[str]:
        info = compiled_info(self._compiled)
        if info is None:
            return []
        return [
            "the torch.compile'd model was traced as its eager module (fake tensors cannot run compiled code); "
            "compiled code can use less memory (fused kernels keep fewer intermediates)"
            + ("; it was compiled with dynamic=False, which recompiles per batch size" if info.dynamic is False else "")
        ]
