"""The [`Prober`][batchfit.Prober]: the lifetime of a probe, and its trials.

It validates the input, snapshots the user's model and optimizer, moves the model to the probe
device, warms the device up, applies the memory limit, runs trials on request, and in
``__exit__`` (also on an error or Ctrl-C) undoes all of it and releases the memory. Everything
device-specific is asked of the device's backend (``batchfit.backends``); the ranks that probe
together are ``batchfit.distributed``'s. The search that drives it is ``batchfit.probe.finder``.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Sequence
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from batchfit.backends import Meter, backend_for, resolve_device
from batchfit.backends.select import is_host
from batchfit.distributed import Solo, ranks_for
from batchfit.errors import DeviceFailedError, annotate
from batchfit.interrupts import InterruptGuard
from batchfit.probe.batches import batch_size_of, tensor_leaves, to_device
from batchfit.probe.checks import (
    check_materialised,
    check_work,
    fit_memory,
    fixed_memory_advice,
    loss_notes,
    output_notes,
    parameter_bytes,
)
from batchfit.probe.compiled import compile_notes, compile_seconds, compiled_info
from batchfit.probe.keywords import FindOptions, check_keywords
from batchfit.probe.notes import ranks_notes
from batchfit.probe.options import Options
from batchfit.probe.per_rank import per_rank
from batchfit.probe.positions import check_seq_len
from batchfit.probe.real_data import worst_batch
from batchfit.probe.runner import Findings, GroupAnswer, Settled, Setup, Traits, TrialRequest, opened
from batchfit.probe.state import Snapshot, take
from batchfit.probe.trial import run_trial, state_bytes
from batchfit.probe.workload import AMP_DTYPES, Workload, optimizer_factory
from batchfit.report import DeviceInfo, SizedOn, Trial, TrialKind, Unit
from batchfit.units import format_bytes, parse_memory_limit, parse_reserve, positive_int

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Prober"]


class Prober:
    """Runs trials of one workload on one device, and leaves everything as it found it.

    Use as a context manager:

    ```python
    with batchfit.Prober(model, sample, memory_limit="8GiB") as prober:
        trial = prober.trial(64)          # a real Trial: fits, peak_bytes, samples_per_s...
    ```

    Keywords are [`batchfit.find`][batchfit.find]'s (an [`Options`][batchfit.Options] as ``options=``,
    keywords override it); the search keywords are accepted and ignored here. It is a `Runner`
    (`batchfit.probe.runner`): ``with`` and `trial` are `open`, `close` and `run` by other names.
    """

    def __init__(
        self, model: nn.Module, sample: Any = None, *, options: Options | None = None, **kwargs: Unpack[FindOptions]
    ) -> None:
        check_keywords("Prober", kwargs, FindOptions)
        options = Options(**kwargs) if options is None else replace(options, **kwargs)
        #: Things the probe's set-up wants the result to say (a clipped budget, ...).
        self.notes: list[str] = []
        self._told = 0  # the notes handed on so far (`_news`)
        self._output_said = False  # the note on the output held through backward, after the first step
        check_seq_len(model, options.seq_len)  # before a loader is scanned
        sample, drawn, sized_on = worst_batch(sample, options)
        #: Which batch of real data the sizes are built from (``batchfit.probe.real_data``), or ``None``.
        self.sized_on: SizedOn | None = sized_on
        if drawn is not None:
            self.notes.append(drawn)
        check_work(model, sample, options)
        check_materialised(model, sample)
        self.options = options
        self.mode = options.mode
        self._sample_size = batch_size_of(sample) if sample is not None else None
        self._user_optimizer = options.optimizer if isinstance(options.optimizer, torch.optim.Optimizer) else None
        self._new_optimizer = optimizer_factory(options.optimizer)
        self.device = resolve_device(options.device, model)
        self.backend = backend_for(self.device)
        self.device_info: DeviceInfo = self.backend.describe(self.device)
        self._model = model
        self.notes += loss_notes(model, sample, options)
        #: What the trials call: the model itself, or the eager module inside a compiled one.
        self._run_model = self._runnable(model)
        #: ``torch.compile`` settings of the model (``batchfit.probe.compiled``), and whether trials run it compiled.
        self.compiled = compiled_info(model)
        self._runs_compiled = self.compiled is not None and self._run_model is model
        self._compile_started = compile_seconds() if self.compiled is not None else 0.0
        self._raw_sample = sample
        self.limit_bytes, self.limit_source, self.reserve_bytes = self._resolve_limit()
        self.budget_bytes: int | None = None
        self.meter: Meter | None = None
        self.optimizer_state_bytes = 0
        self._grad_scale: float | None = None
        #: The optimizer of the last trial, whose state is live (see ``trial.py``): handed on.
        self._optimizer: torch.optim.Optimizer | None = None
        self._interrupts = InterruptGuard(exits=(Prober.__exit__, Prober.close, Prober._finish, opened.__exit__))
        #: The processes that probe together (``batchfit.distributed.ranks``): this one, or every rank.
        self.ranks: Solo = ranks_for(options.distributed, options.wait_for_ranks_s, model, self._interrupts)
        # Across ranks a Ctrl-C is raised at the next meeting, on every rank at once.
        self._interrupts.deferred = self.ranks.world_size > 1
        self._workload: Workload | None = None
        self._snapshot: Snapshot | None = None
        self._stack: contextlib.ExitStack | None = None

    def _runnable(self, model: nn.Module) -> nn.Module:
        """A ``torch.compile``d model runs eagerly where the backend's meter cannot run compiled
        code (the CPU's dispatch mode): calling it compiled there would make dynamo skip its
        frames for good, and the user's model would never compile again in this process."""
        inner = getattr(model, "_orig_mod", None)
        if inner is None or self.backend.runs_compiled or not isinstance(inner, nn.Module):
            return model
        self.notes.append(
            f"the torch.compile'd model was probed eagerly on {self.device.type} (its meter cannot run compiled "
            "code, and dynamo would stop compiling the model for good); compiled code can use less memory"
        )
        return inner

    @property
    def workload(self) -> Workload:
        """What a step runs here (model, loss, autocast), for work beside the trials (the noise scale)."""
        if self._workload is None:
            raise RuntimeError("Prober.workload needs an active probe: use 'with Prober(...) as p:'")
        return self._workload

    @property
    def slows_steps(self) -> bool:
        """Whether the meter's bookkeeping slows every step (``Meter.observes_operations``) and a
        timed step may run without it: not under ``torch.compile``, whose guards would see the
        dispatch mode go and compile again inside the timed step."""
        return self.meter is not None and self.meter.observes_operations and not self._runs_compiled

    @property
    def counts(self) -> Unit:
        """The memory the budget counts on this device (see ``batchfit.backends.base``)."""
        return self.meter.counts if self.meter is not None else "allocated"

    def _resolve_limit(self) -> tuple[int | None, str, int]:
        """The limit in bytes (``reserve`` taken off), where it came from, and the reserve."""
        backend, device, options = self.backend, self.device, self.options
        if options.memory_limit is None:
            if options.reserve is not None:
                raise ValueError("reserve= only applies with a memory_limit (it is taken off the limit)")
            limit, source = backend.default_limit(device)
            return limit, source, 0
        limit = parse_memory_limit(options.memory_limit, backend.limit_total_bytes(device))
        if options.reserve is None:
            return limit, "memory_limit", 0
        parsed = parse_reserve(options.reserve)
        reserve = backend.outside_allocator_bytes(device) if parsed == "auto" else int(parsed)
        if reserve >= limit:
            raise ValueError(
                f"reserve {format_bytes(reserve)} is not below memory_limit {format_bytes(limit)}: nothing is left"
            )
        return limit - reserve, f"memory_limit {format_bytes(limit)} less reserve {format_bytes(reserve)}", reserve

    # lifetime ------------------------------------------------------------------------------------
    def __enter__(self) -> Prober:
        self.open()
        return self

    def open(self) -> Setup:
        """The set-up (`Runner.open`); Ctrl-C is deferred to safe points from here until the restore has finished."""
        self._interrupts.__enter__()
        try:
            self.ranks.join(self.options.answer_settings())  # every option that changes the answer
            with self.ranks.meet("the probe's set-up"):
                self._snapshot = take(self._model, self._user_optimizer, self.backend, self.device)
                self._stack = contextlib.ExitStack()
                self._prepare()
            if self.ranks.world_size > 1:
                self._agree_on_budget()
        except BaseException as exc:
            self._finish(device_usable=True, exc=exc)
            raise
        layout = self.meter is not None and self.meter.layout_carries  # times warm: one process keeps running
        traits, self._told = Traits(layout, self.slows_steps, times_warm=True), 0
        facts = (self.budget_bytes, self.counts, self.device_info, self.ranks, self.limit_bytes, self.limit_source)
        return Setup(*facts, self.reserve_bytes, traits, self.sized_on, self._news())

    def _news(self) -> tuple[str, ...]:  # the notes added since the last ones were handed on
        news, self._told = tuple(self.notes[self._told :]), len(self.notes)
        return news

    def join_ranks(self) -> None:
        """Meet the other ranks before the probe (the result cache decides for all of them first:
        ``batchfit.probe.cache``); ``__enter__`` then finds them met. Undone by ``ranks.close()``."""
        self.ranks.join(self.options.answer_settings())  # every option that changes the answer

    @property
    def model_for_key(self) -> nn.Module:
        """The user's model, as given (wrappers included): the result cache keys on its structure."""
        return self._model

    @property
    def sized_sample(self) -> Any:
        """The batch the sizes are built from (a loader's worst batch, cut to ``seq_len``), ``None``
        with ``make_batch``: the result cache keys on its shapes."""
        return self._raw_sample

    def _agree_on_budget(self) -> None:
        """The budget of the group: the smallest rank's (heterogeneous or partly occupied devices)."""
        mine = self.budget_bytes
        self.budget_bytes = self.ranks.smallest(mine)
        if self.budget_bytes is not None and self.budget_bytes != mine:
            self.notes.append(
                f"the budget is {format_bytes(self.budget_bytes)}, the smallest rank's"
                + (f" (this rank's is {format_bytes(mine)})" if mine is not None else "")
            )

    def _prepare(self) -> None:
        model, device, options = self._model, self.device, self.options
        with torch.no_grad():
            for param in model.parameters():
                param.grad = None
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.device != device:
                    tensor.data = tensor.data.to(device)
        model.train(self.mode == "train")
        sample = to_device(self._raw_sample, device) if self._raw_sample is not None else None
        self._workload = Workload(
            model=self._run_model,
            device=device,
            sample=sample,
            sample_size=self._sample_size,
            new_optimizer=self._new_optimizer,
            dynamic_batch=self._runs_compiled,
            **Workload.settings_of(options),
        )
        trains = self.mode in ("train", "eval")  # evaluation runs beside the training state
        if trains and not self._workload.trainable_parameters() and options.step_fn is None:
            raise ValueError(
                "the model has no trainable parameter: a "
                + ("training" if self.mode == "train" else "mode='eval' (beside the training state)")
                + " probe needs one (or use mode='inference')"
            )
        if trains:
            # A factory that returns the wrong thing is named now, not as a failure inside a trial.
            # Optimizers allocate their state in step(), so this one costs no memory.
            self._new_optimizer(self._workload.trainable_parameters())
        self.backend.warm_up(device, AMP_DTYPES.get(options.amp or ""))
        if options.reserve == "auto":  # measured once the warm-up made what the device keeps
            self.limit_bytes, self.limit_source, self.reserve_bytes = self._resolve_limit()
        self.budget_bytes = self._budget()
        held = self.ranks.held(model) + [t for _, t in tensor_leaves(sample, "sample")]  # DDP's buckets too
        self.meter = self.backend.make_meter(device, self.budget_bytes, self.limit_bytes, tensors=held)
        self.meter.interrupts = self._interrupts
        assert self._stack is not None
        self._stack.enter_context(self.meter.active())

    def _budget(self) -> int | None:
        """The limit, clipped to what this process can reach on the device (and said so)."""
        reachable = self.backend.reachable_bytes(self.device)
        if self.limit_bytes is None:
            return reachable
        if reachable is not None and self.limit_bytes > reachable:
            self.notes.append(
                f"the memory limit {format_bytes(self.limit_bytes)} is more than this process can reach on "
                f"{self.device} ({format_bytes(reachable)} usable by it, as the backend counts): the budget is "
                f"{format_bytes(reachable)}, and batch sizes are what fits there, not under the limit"
            )
            return reachable
        return self.limit_bytes

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:  # noqa: E501
        self.close((), None, exc)

    def close(self, trials: Sequence[Trial], answer: GroupAnswer | None, exc: BaseException | None) -> Findings:
        """Undo everything (`Runner.close`); with the group's ``answer`` over ranks with different
        budgets, each rank's own answer first (``batchfit.probe.per_rank``)."""
        ranks, meter, own = self.ranks, self.meter, ((), [])
        try:
            if exc is None and answer is not None and ranks.world_size > 1 and meter is not None:
                own = per_rank(ranks, self.run, self.counts, meter.budget_bytes, answer)
        except BaseException as failed:
            exc = failed
            raise
        finally:
            failed_device = isinstance(exc, DeviceFailedError)
            self._finish(device_usable=not failed_device, exc=exc)
            if failed_device and exc is not None and not is_host(self.device):
                annotate(
                    exc,
                    f"batchfit: the model's tensors that were on {self.device} were restored to their exact values "
                    "on the CPU: the device cannot be used again in this process",
                )
        if exc is not None:
            return Findings(fixed_advice=self.fixed_advice())
        seconds = compile_seconds() - self._compile_started if self.compiled is not None else 0.0  # what compiling did
        said = compile_notes(self.compiled, len({t.batch_size for t in trials}), self._runs_compiled, seconds)
        said += meter.notes() if meter is not None else []
        said += ranks_notes(ranks.world_size, ranks.notes(self._run_model))
        return Findings((*self._news(), *said), None, own[0], tuple(own[1]))

    def _finish(self, device_usable: bool, exc: BaseException | None) -> None:
        """Undo everything (no Ctrl-C can cut it short), then let a Ctrl-C that arrived meanwhile
        surface. On a failed device nothing is asked of it: every call would raise and the raw
        device error would replace the one that explains what happened."""
        self._interrupts.finish(lambda: self._undo(device_usable, settled=exc is None), exc)

    def _undo(self, device_usable: bool, settled: bool = False) -> None:
        self._optimizer = None
        self.ranks.close(settled)
        try:
            if self._stack is not None:
                if device_usable:
                    self._stack.close()
                else:
                    with contextlib.suppress(Exception):
                        self._stack.close()
        finally:
            self._stack = None
            self._workload = None
            if self._snapshot is not None:
                self._snapshot.restore(device_usable, restore_rng=self.options.restore_rng)
                self._snapshot = None
            gc.collect()
            if device_usable:
                self.backend.empty_cache(self.device)

    # trials ----------------------------------------------------------------------------------------
    def trial(
        self,
        batch_size: int,
        steps: int | None = None,
        kind: TrialKind = "search",
        fresh_optimizer: bool = False,
        cap_bytes: int | None = None,
        from_scratch: bool = False,
    ) -> Trial:
        """Run one real trial at ``batch_size`` (`run`, whose docs say how)."""
        return self.run(TrialRequest(batch_size, steps, kind, fresh_optimizer, cap_bytes, from_scratch))

    def run(self, request: TrialRequest) -> Trial:
        """Run one real trial at ``request.batch_size`` (`Runner.run`).

        The optimizer of the previous trial is kept, state and all, and used again (the state
        does not depend on the batch size, and a real run holds it from its first step on), so
        ``steps`` defaults to ``steps_per_trial`` or, without one, to the fewest steps that show
        the peak with the optimizer state live: one once an earlier trial stepped, else two.
        ``fresh_optimizer``: drop the kept one first and start as a real run does (step 1
        allocates the state). ``cap_bytes``: run under this lower limit (the safe batch's
        verification runs under the budget less its headroom: ``Meter.capped``).
        ``from_scratch``: a replay of a fresh training process (a fresh optimizer too): where the layout
        carries between trials (CUDA), nothing cached and no cuBLAS workspace when it starts
        (`Meter.fresh_process`), and steps until the layout settles (`run_trial`'s ``settle``).
        """
        if self._workload is None or self.meter is None:
            raise RuntimeError("Prober.trial() needs an active probe: use 'with Prober(...) as p:'")
        steps, kind, cap_bytes, from_scratch = request.steps, request.kind, request.cap_bytes, request.from_scratch
        batch_size = positive_int("batch_size", request.batch_size)
        fresh_optimizer = request.fresh_optimizer or from_scratch
        replay = from_scratch and self.meter.layout_carries
        if fresh_optimizer and self._optimizer is not None:  # a collection (~150 ms) only if its state outlives it
            held, self._optimizer = self.meter.allocated_bytes() - state_bytes(self._optimizer, self.meter), None
            self.meter.release(target_bytes=held)
        if steps is None:  # the fewest that count the optimizer state (step 1 of a fresh one makes it), and 2
            # where the first step after a release runs cold (`Backend.cold_after_release`: on CUDA cudaMalloc...)
            verdict = 1 if self.mode != "train" or self._optimizer is not None else 2
            steps = self.options.steps_per_trial or max(verdict, 2 if self.backend.cold_after_release else 1)
        else:
            steps = positive_int("steps", steps)
        if self._runs_compiled:
            # Step 1 at a new shape may compile: the timed step must not. Under CUDA graphs
            # step 2 records the graph and only step 3 replays it, as training runs.
            steps = max(steps, 3 if self.compiled is not None and self.compiled.cudagraphs else 2)
        self._interrupts.check()
        kept, self._optimizer = self._optimizer, None
        # A timing trial's steps after the first, and a verification's beyond `verify_steps`, are
        # timed without a meter that slows every step; the steps before them measured their memory.
        measured = 1 if kind == "time" else self.options.verify_steps if kind == "verify" else steps
        plain_from = measured if self.slows_steps and 0 < measured < steps else None
        fresh = self.meter.fresh_process() if replay else contextlib.nullcontext()
        with self.meter.capped(cap_bytes), fresh:
            workload, scale, ranks = self._workload, self._grad_scale, self.ranks
            run = run_trial(workload, self.meter, batch_size, steps, kind, scale, kept, ranks, plain_from, replay)
        del kept
        if replay:  # the workspaces the replay freed, made again where the probe's other trials expect them
            self.backend.warm_up(self.device, AMP_DTYPES.get(self.options.amp or ""))
        if run.output_kept is not None and not self._output_said:
            self._output_said = True
            self.notes += output_notes(run.output_kept, self.options)
        self._optimizer = run.optimizer
        self._interrupts.check()
        self._grad_scale = run.grad_scale
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, run.optimizer_state_bytes)
        return self.ranks.combine(run.trial)

    def fixed_advice(self) -> str | None:
        """What to say when not even the first batch fits and the memory that does not depend
        on the batch (weights, gradients, the optimizer's state) already exceeds the budget."""
        weights, trainable = parameter_bytes(self._model)
        return fixed_memory_advice(weights, trainable, self.mode, self.options.optimizer, self.budget_bytes)

    def settle(self, trials: Sequence[Trial]) -> Settled:
        """The budget after the search (`settle_reserve`) and the memory equation of ``trials`` (`Runner.settle`)."""
        budget = self.settle_reserve()
        weights, trainable = parameter_bytes(self._model)
        memory = fit_memory(
            list(trials), weights, trainable, self.mode, self.optimizer_state_bytes, self.counts, budget
        )  # noqa: E501
        return Settled(budget, self.limit_bytes, self.limit_source, self.reserve_bytes, memory, self._news())

    def settle_reserve(self) -> int | None:
        """The budget, after ``reserve="auto"`` measured again what lives outside the allocator.

        The first measure is taken after the warm-up, but the CUDA context keeps growing later:
        kernels load lazily on their first launch, cuDNN and cuBLAS make handles on first use.
        A card of the limit's size holds all of that, so when it grew the budget shrinks by as
        much (said in a note): the safe batch is then chosen and verified under the new budget.
        """
        if self.options.reserve != "auto" or self.meter is None or self.limit_bytes is None:
            return self.budget_bytes
        outside = self.backend.outside_allocator_bytes(self.device)
        grown = max(0, outside - self.reserve_bytes)
        searched = budget = self.budget_bytes
        if grown:
            self.reserve_bytes = outside
            self.limit_bytes -= grown
            self.limit_source = f"{self.limit_source.split(' less reserve')[0]} less reserve {format_bytes(outside)}"
            budget = self.limit_bytes if budget is None else min(budget, self.limit_bytes)
        # Every rank takes part in the agreement, grown or not (a collective must be met by all).
        budget = self.ranks.smallest(budget) if self.ranks.world_size > 1 else budget
        if budget == searched:
            return searched
        self.budget_bytes = self.meter.budget_bytes = budget
        self.notes.append(
            f"reserve='auto' grew by {format_bytes(grown)} during the search: the safe batch was verified under "
            f"{format_bytes(budget or 0)}, the largest found under {format_bytes(searched or 0)} "
            "(see docs/concepts/measuring.md#cuda)"
        )
        return self.budget_bytes
