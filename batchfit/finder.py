"""``find()``: the search, run on real trials, assembled into a :class:`Result`.

:class:`Prober` owns the lifetime of a probe: it validates the input, snapshots the user's
model and optimizer, moves the model to the probe device, warms the device up, applies the
memory limit, runs trials on request, and in ``__exit__`` (also on an error or Ctrl-C) undoes
all of it and releases the memory. Everything device-specific is asked of the device's
backend (``batchfit.backends``). :func:`find` drives a :class:`Prober` with the pure search
from ``search.py``, then picks and verifies a safe batch.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from batchfit import search as search_mod
from batchfit.backends import Meter, backend_for, resolve_device
from batchfit.compiled import compile_notes, compile_seconds, compiled_info
from batchfit.errors import DeviceFailedError, NothingFitsError
from batchfit.interrupts import InterruptGuard
from batchfit.oom import annotate
from batchfit.options import DEFAULT_MAX_BATCH, Options, positive_int
from batchfit.ranks import Solo, ranks_for
from batchfit.result import DeviceInfo, MemoryModel, Result, Settings, Throughput, Trial, TrialKind, Unit
from batchfit.state import Snapshot, take
from batchfit.trial import run_trial
from batchfit.units import format_bytes, parse_memory_limit, parse_reserve
from batchfit.version import __version__
from batchfit.workload import (
    AMP_DTYPES,
    Workload,
    batch_size_of,
    optimizer_factory,
    split_pair,
    tensor_leaves,
    to_device,
)

TrialCallback = Callable[[Trial], None]
StartCallback = Callable[[int, str], None]
ProbeStartCallback = Callable[[DeviceInfo, "int | None"], None]

__all__ = ["DEFAULT_MAX_BATCH", "Prober", "find", "find_with", "search_with"]


class Prober:
    """Runs trials of one workload on one device, and leaves everything as it found it.

    Use as a context manager::

        with batchfit.Prober(model, sample, memory_limit="8GiB") as prober:
            trial = prober.trial(64)          # a real Trial: fits, peak_bytes, samples_per_s...

    Keywords are :func:`batchfit.find`'s (an :class:`~batchfit.options.Options` as ``options=``,
    keywords override it); the search keywords are accepted and ignored here.
    """

    def __init__(self, model: nn.Module, sample: Any = None, *, options: Options | None = None, **kwargs: Any) -> None:
        options = Options(**kwargs) if options is None else replace(options, **kwargs)
        #: Things the probe's set-up wants the result to say (a clipped budget, ...).
        self.notes: list[str] = []
        sample = self._first_batch(sample)
        check_work(model, sample, options)
        _check_materialised(model, sample)
        if options.criterion is not None and sample is not None:
            split_pair(sample)  # (inputs, targets) or a clear error now, not in a trial
        self.options = options
        self.mode = options.mode
        self._sample_size = batch_size_of(sample) if sample is not None else None
        self._user_optimizer = options.optimizer if isinstance(options.optimizer, torch.optim.Optimizer) else None
        self._new_optimizer = optimizer_factory(options.optimizer)
        self.device = resolve_device(options.device, model)
        self.backend = backend_for(self.device)
        self.device_info: DeviceInfo = self.backend.describe(self.device)
        self._model = model
        self.notes += _loss_notes(model, sample, options)
        #: What the trials call: the model itself, or the eager module inside a compiled one.
        self._run_model = self._runnable(model)
        #: ``torch.compile`` settings of the model (``batchfit.compiled``), and whether trials run it compiled.
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
        self._interrupts = InterruptGuard()
        #: The processes that probe together (``batchfit.ranks``): this one, or every rank.
        self.ranks: Solo = ranks_for(options, model, self._interrupts)
        # Across ranks a Ctrl-C is raised at the next meeting, on every rank at once.
        self._interrupts.deferred = self.ranks.world_size > 1
        self._workload: Workload | None = None
        self._snapshot: Snapshot | None = None
        self._stack: contextlib.ExitStack | None = None

    def _first_batch(self, sample: Any) -> Any:
        """The sample itself, or the first batch of a ``DataLoader`` (or of any other iterable of
        batches that is not itself a batch), as users hold their data; said in a note."""
        from torch.utils.data import DataLoader

        is_batch = isinstance(sample, (torch.Tensor, Mapping, tuple, list, str, bytes)) or sample is None
        if is_batch or not (isinstance(sample, DataLoader) or hasattr(sample, "__iter__")):
            return sample
        try:
            first = next(iter(sample))
        except StopIteration:
            raise ValueError(f"the sample {type(sample).__name__} yielded no batch: it is empty") from None
        self.notes.append(
            f"sample: the first batch of the {type(sample).__name__} (batch size {batch_size_of(first)}), "
            "repeated along dim 0 to build every size"
        )
        return first

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
        # Ctrl-C is deferred to safe points from here until the restore has finished.
        self._interrupts.__enter__()
        try:
            self.ranks.join(self._search_settings())
            with self.ranks.meet("the probe's set-up"):
                self._snapshot = take(self._model, self._user_optimizer, self.backend, self.device)
                self._stack = contextlib.ExitStack()
                self._prepare()
            if self.ranks.world_size > 1:
                self._agree_on_budget()
        except BaseException as exc:
            self._finish(device_usable=True, exc=exc)
            raise
        return self

    def _search_settings(self) -> dict[str, Any]:
        """What every rank must search with alike, or the ranks would take different paths."""
        options, grid = self.options, self.options.grid()
        return {
            "init_batch": grid.init,
            "max_batch": grid.maximum,
            "multiple_of": grid.multiple_of,
            "strategy": options.make_strategy().name,
            "headroom": float(options.headroom),
            "verify_steps": options.verify_steps,
            "steps_per_trial": options.steps_per_trial,
            "mode": options.mode,
            "amp": options.amp,
            "time_budget": options.time_budget,
        }

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
            mode=self.mode,
            sample=sample,
            sample_size=self._sample_size,
            make_batch=options.make_batch,
            loss_fn=options.loss_fn,
            step_fn=options.step_fn,
            new_optimizer=self._new_optimizer,
            amp=options.amp,
            dynamic_batch=self._runs_compiled,
            criterion=options.criterion,
        )
        if self.mode == "train" and not self._workload.trainable_parameters() and options.step_fn is None:
            raise ValueError(
                "the model has no trainable parameter: a training probe needs one (or use mode='inference')"
            )
        if self.mode == "train":
            # A factory that returns the wrong thing is named now, not as a failure inside a trial.
            # Optimizers allocate their state in step(), so this one costs no memory.
            self._new_optimizer(self._workload.trainable_parameters())
        self.backend.warm_up(device, AMP_DTYPES.get(options.amp or ""))
        if options.reserve == "auto":  # measured once the warm-up made what the device keeps
            self.limit_bytes, self.limit_source, self.reserve_bytes = self._resolve_limit()
        self.budget_bytes = self._budget()
        held = [*model.parameters(), *model.buffers()] + [t for _, t in tensor_leaves(sample, "sample")]
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
                f"{self.device} ({format_bytes(reachable)} free or held by it): the budget is "
                f"{format_bytes(reachable)}, and batch sizes are what fits there, not under the limit"
            )
            return reachable
        return self.limit_bytes

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        failed = isinstance(exc, DeviceFailedError)
        self._finish(device_usable=not failed, exc=exc)
        if failed and exc is not None and self.device.type != "cpu":
            annotate(
                exc,
                f"batchfit: the model's tensors that were on {self.device} were restored to their exact values "
                "on the CPU: the device cannot be used again in this process",
            )

    def _finish(self, device_usable: bool, exc: BaseException | None) -> None:
        """Undo everything (no Ctrl-C can cut it short), then let a Ctrl-C that arrived meanwhile
        surface. On a failed device nothing is asked of it: every call would raise and the raw
        device error would replace the one that explains what happened."""
        try:
            with self._interrupts.critical():
                self._undo(device_usable)
        finally:
            self._interrupts.__exit__(type(exc) if exc else None, exc, None)

    def _undo(self, device_usable: bool) -> None:
        self._optimizer = None
        self.ranks.close()
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
        self, batch_size: int, steps: int | None = None, kind: TrialKind = "search", fresh_optimizer: bool = False
    ) -> Trial:
        """Run one real trial at ``batch_size``.

        The optimizer of the previous trial is kept, state and all, and used again (the state
        does not depend on the batch size, and a real run holds it from its first step on), so
        ``steps`` defaults to ``steps_per_trial`` or, without one, to the fewest steps that show
        the peak with the optimizer state live: one once an earlier trial stepped, else two.
        ``fresh_optimizer``: drop the kept one first and start as a real run does (step 1
        allocates the state).
        """
        if self._workload is None or self.meter is None:
            raise RuntimeError("Prober.trial() needs an active probe: use 'with Prober(...) as p:'")
        batch_size = positive_int("batch_size", batch_size)
        if fresh_optimizer and self._optimizer is not None:
            self._optimizer = None
            self.meter.release()
        if steps is None:
            steps = self.options.steps_per_trial or self.verdict_steps
        else:
            steps = positive_int("steps", steps)
        if self._runs_compiled:
            steps = max(steps, 2)  # step 1 at a new shape may compile: the timed step must not
        self._interrupts.check()
        kept, self._optimizer = self._optimizer, None
        run = run_trial(self._workload, self.meter, batch_size, steps, kind, self._grad_scale, kept, self.ranks)
        del kept
        self._optimizer = run.optimizer
        self._interrupts.check()
        self._grad_scale = run.grad_scale
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, run.optimizer_state_bytes)
        return self.ranks.combine(run.trial)

    def ranks_notes(self) -> list[str]:
        """What the ranks have to say about this model (``batchfit.ranks``)."""
        return self.ranks.notes(self._run_model)

    def compile_notes(self, trials: list[Trial]) -> list[str]:
        """What to say about a ``torch.compile``'d model (``batchfit.compiled``)."""
        seconds = compile_seconds() - self._compile_started if self.compiled is not None else 0.0
        sizes = len({t.batch_size for t in trials})
        return compile_notes(self.compiled, sizes, self._runs_compiled, seconds)

    @property
    def verdict_steps(self) -> int:
        """The fewest steps whose peak counts the optimizer state: 1 while an earlier trial's
        optimizer is kept (and in inference), 2 with a fresh one (step 1 allocates the state)."""
        return 1 if self.mode != "train" or self._optimizer is not None else 2

    def fixed_advice(self) -> str | None:
        """What to say when not even the first batch fits and the memory that does not depend
        on the batch (weights, gradients, the optimizer's state) already exceeds the budget."""
        weights, trainable = parameter_bytes(self._model)
        return fixed_memory_advice(weights, trainable, self.mode, self.options.optimizer, self.budget_bytes)

    def memory_model(self, trials: list[Trial]) -> MemoryModel | None:
        """The memory equation of ``trials``, in the unit the budget counts."""
        weights, trainable = parameter_bytes(self._model)
        return fit_memory(trials, weights, trainable, self.mode, self.optimizer_state_bytes, self.counts)


def parameter_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes of the model's parameters (each once: ``parameters()`` skips tied repeats), and of
    those that train (and so get gradients)."""
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    return weights, sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def fit_memory(
    trials: list[Trial], weights: int, trainable: int, mode: str, optimizer_state: int, unit: Unit
) -> MemoryModel | None:
    """The memory equation of ``trials`` with its breakdown; gradients only when training."""
    return MemoryModel.fit(trials, weights, trainable if mode == "train" else 0, optimizer_state, unit=unit)


def check_work(model: Any, sample: Any, options: Options) -> None:
    """What every probe (real or estimated) checks first: a module, and exactly one of a sample
    and ``make_batch``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if (sample is None) == (options.make_batch is None):
        raise TypeError(
            "pass exactly one of sample= (one batch; its first dimension is the batch) "
            "or make_batch= (a callable batch_size -> batch)"
            if sample is None
            else "pass either sample or make_batch, not both"
        )


def fixed_memory_advice(weights: int, trainable: int, mode: str, optimizer: Any, budget: int | None) -> str | None:
    """:meth:`Prober.fixed_advice` from the parameter bytes (shared with ``batchfit.estimation``)."""
    if mode != "train":
        parts, fixed = f"the weights alone need {format_bytes(weights)}", weights
    else:
        # AdamW (the default, and the Adam family) keeps two moments per trainable parameter.
        adam = optimizer is None or isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
        state = 2 * trainable if adam else 0
        fixed = weights + trainable + state
        parts = (
            f"the weights ({format_bytes(weights)}), their gradients ({format_bytes(trainable)})"
            + (f" and AdamW's two moments ({format_bytes(state)})" if state else "")
            + f" alone need {format_bytes(fixed)}"
        )
    if budget is None or fixed <= budget:
        return None
    return (
        f"{parts[0].upper()}{parts[1:]}, more than the budget: lowering init_batch cannot help. Raise "
        "memory_limit, use a smaller model, or an optimizer with less state (SGD, or 8-bit/factored moments)."
    )


def _loss_notes(model: nn.Module, sample: Any, options: Options) -> list[str]:
    """A Hugging Face head model given no ``labels`` returns logits and no loss, and the default
    loss (``logits.mean()``) skips what the real loss holds (a cross-entropy over a 50k vocabulary
    is the biggest tensor of a small GPT-2's step): the batch found is then too large. Say so."""
    if options.mode != "train" or options.loss_fn or options.step_fn or options.criterion:
        return []
    hugging_face = any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)
    if not hugging_face or not isinstance(sample, Mapping) or "labels" in sample:
        return []
    return [
        "the sample has no 'labels', so the Hugging Face model returns logits and no loss, and batchfit used "
        "logits.mean() as the loss: a real loss (cross-entropy over the classes or the vocabulary) holds more "
        "memory, so the batch sizes found are too large. Put labels in the sample (a causal LM takes labels = "
        "input_ids) or pass loss_fn="
    ]


def _check_materialised(model: nn.Module, sample: Any) -> None:
    """Refuse, with the reason, what no trial could run: tensors without data (the ``meta``
    device) and lazy modules whose shapes are not known yet."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if is_lazy(tensor):
            raise ValueError(
                f"the model's {name} is an uninitialized lazy parameter (a torch.nn.Lazy* module): run one forward "
                "pass on a sample before probing, so that its shape is known"
            )
        if tensor.is_meta:
            raise ValueError(
                f"the model's {name} is on the meta device, which holds no data: materialise the model "
                "(model.to_empty(device=...), then initialise its weights) before probing"
            )
    for path, tensor in tensor_leaves(sample, "sample") if sample is not None else ():
        if tensor.is_meta:
            raise ValueError(f"{path} is on the meta device, which holds no data: pass a sample with real values")


def find(
    model: nn.Module,
    sample: Any = None,
    *,
    make_batch: Callable[[int], Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    step_fn: Callable[[nn.Module, Any], Any] | None = None,
    criterion: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: Any = None,
    amp: str | None = None,
    mode: str = "train",
    device: str | torch.device | None = None,
    memory_limit: int | float | str | None = None,
    reserve: int | str | None = None,
    headroom: float = 0.10,
    init_batch: int | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    multiple_of: int = 1,
    steps_per_trial: int | None = None,
    verify_steps: int = 3,
    strategy: str | search_mod.Strategy = "interpolate",
    time_budget: float | None = None,
    restore_rng: bool = True,
    distributed: bool | None = None,
    rank_timeout: float = 300.0,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
    progress: bool = False,
) -> Result:
    """Find the largest batch that trains, a safe batch with headroom, and the fastest batch.

    Runs real steps (forward, loss, backward, optimizer step; forward only with
    ``mode="inference"``) at growing batch sizes until one runs out of memory, then
    searches the boundary. The model, its buffers, train/eval flags, gradients, the given
    optimizer and the RNG state are restored exactly afterwards, whatever happens.

    Args:
        model: the ``nn.Module`` to probe.
        sample: one batch as the model takes it (tensor -> ``model(x)``, tuple/list ->
            ``model(*x)``, mapping -> ``model(**x)``); batches are built by repeating its rows.
        make_batch: instead of ``sample``, a callable ``batch_size -> batch``.
        loss_fn: ``(output, batch) -> loss``; default: ``output.loss`` or the output's mean.
        step_fn: ``(model, batch) -> loss``, replaces forward and loss entirely.
        optimizer: ``None`` (a fresh AdamW), an optimizer (a fresh one of its class and
            hyperparameters is used; yours is never stepped) or a factory ``params -> optimizer``.
        amp: ``"bf16"`` or ``"fp16"`` to run under autocast (fp16 with a grad scaler; steps whose
            optimizer update the scaler skips do not count, see ``Trial.skipped_steps``).
        mode: ``"train"`` or ``"inference"`` (forward only, under ``torch.inference_mode``).
        device: where to probe; default: where the model is. The model comes back afterwards.
        memory_limit: bytes, a size (``"24GiB"``) or a fraction of the device's memory (CUDA: its
            total as the runtime reports it; CPU: what is available at the start). On CUDA it caps
            what the caching allocator may reserve; on the CPU, live tensor bytes. Without one:
            on CUDA the memory this process can reach, on the CPU half the available memory.
            A limit above what the process can reach is clipped to it, with a note.
        reserve: bytes (or a size) taken off ``memory_limit`` for memory a device of that size
            loses outside the caching allocator (CUDA context, library handles, NCCL), so that
            ``memory_limit="24GB", reserve="600MiB"`` stands for a 24 GB card. ``"auto"``: what
            the device uses outside this process's allocator now (the context, and any other
            process's memory). Default: nothing.
        headroom: the fraction of the budget the safe batch leaves free.
        init_batch: the first size tried. Default: 2, or ``multiple_of`` when that is larger.
            Batch 1 is skipped by default because BatchNorm cannot train on one sample
            ("Expected more than 1 value per channel"); pass ``init_batch=1`` to include it.
        max_batch: the largest size tried.
        multiple_of: only multiples of this are tried (e.g. 8 for tensor cores).
        steps_per_trial: steps per search trial. Default: the fewest that give the memory
            verdict. The optimizer (and its state) is kept from trial to trial, as a real run
            keeps it, so the first trial runs two steps (step 1 allocates the state) and every
            later one a single step whose peak has the state live. With N steps, step 1 warms
            up and steps 2..N are timed.
        verify_steps: steps run at the safe batch to check it, with a fresh optimizer as the
            first steps of a real run (default 3: step 1 allocates the optimizer state, steps
            2 and 3 run with it and are timed; 0 skips the check).
        strategy: ``"interpolate"`` (default: aims at the size where the measured memory lines
            meet the budget, bracketed so it stays exact) or ``"binary"`` (plain doubling and
            bisection), or a strategy object (see ``batchfit.search.Strategy``).
        time_budget: seconds after which no new search trial starts.
        restore_rng: put the CPU and device random generators back as they were (default). The
            generators are process-wide: a probe in a background thread that restores them
            replays numbers other threads drew meanwhile; pass ``False`` there (the probe's
            dropout then consumes random numbers as a training step would).
        distributed: probe with every rank of the initialised default process group (torchrun,
            DDP): every rank calls ``find()`` with the same arguments, the ranks agree on each
            trial, and every rank gets the same result, per-rank batch sizes that fit on every
            rank (see the README's "Many GPUs"). Default ``None``: when a default process group
            of more than one rank is initialised. ``False``: this process alone.
        rank_timeout: seconds a rank waits for the others at a meeting point (starting the
            probe, the end of each phase of a step) before raising
            :class:`~batchfit.errors.RanksTimeoutError` instead of hanging.
        callback: called with every finished :class:`Trial` (search and verification).
        on_trial_start: called with ``(batch_size, kind)`` before each trial.
        on_start: called once with ``(device_info, budget_bytes)`` when the probe is set up and
            before the first trial, so a front end can draw memory against the budget from the
            start (on CUDA without a limit the budget is only known then).
        progress: show the command line's view on stderr while it runs (a live table on a
            terminal, plain lines elsewhere) and its summary at the end; the callbacks above
            still run. Default: nothing is printed.
        criterion: for ``(inputs, targets)`` batches (``find(resnet, (x, y), criterion=
            nn.CrossEntropyLoss())``): the model is called with the inputs and the loss is
            ``criterion(output, targets)``.

    Raises:
        NothingFitsError: even ``init_batch`` runs out of memory.
        LimitError: on CUDA, this process already holds more than ``memory_limit``.
        DeviceFailedError: the device failed for good (device-side assert, illegal address).
        RankFailedError: across ranks, another rank raised an error that is not an
            out-of-memory (it names the rank, the batch size and the error).
        RanksTimeoutError: across ranks, not every rank reached a meeting point in time.
        TypeError, ValueError: bad arguments, with a message naming the problem.
        Any exception from the model that is not an out-of-memory, unchanged, with a note that
        names the batch size.
    """
    options = Options(
        make_batch=make_batch,
        loss_fn=loss_fn,
        step_fn=step_fn,
        criterion=criterion,
        optimizer=optimizer,
        amp=amp,  # type: ignore[arg-type]
        mode=mode,  # type: ignore[arg-type]
        device=device,
        memory_limit=memory_limit,
        reserve=reserve,
        steps_per_trial=steps_per_trial,
        headroom=headroom,
        init_batch=init_batch,
        max_batch=max_batch,
        multiple_of=multiple_of,
        verify_steps=verify_steps,
        strategy=strategy,
        time_budget=time_budget,
        restore_rng=restore_rng,
        distributed=distributed,
        rank_timeout=rank_timeout,
    )
    if not progress:
        return find_with(model, sample, options, callback=callback, on_trial_start=on_trial_start, on_start=on_start)
    from batchfit.view import Progress

    with Progress(type(model).__name__, callback, on_trial_start, on_start) as shown:
        result = find_with(model, sample, options, **shown.callbacks())
        shown.summary(result)
    return result


def find_with(
    model: nn.Module,
    sample: Any,
    options: Options,
    *,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
) -> Result:
    """:func:`find` for callers that hold an :class:`~batchfit.options.Options` (the CLI, the gate)."""
    started = time.monotonic()
    _check_callbacks(callback, on_trial_start, on_start)
    prober = Prober(model, sample, options=options)
    return search_with(prober, options, started, callback=callback, on_trial_start=on_trial_start, on_start=on_start)


def search_with(
    prober: Any,
    options: Options,
    started: float,
    *,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
) -> Result:
    """The search, the safe batch and the :class:`Result`, over any ``prober`` that does what
    :class:`Prober` does (a context manager with ``trial()``, ``budget_bytes``, ``counts``,
    ``device_info``, ``notes``, ``ranks``, ``memory_model()``, ``fixed_advice()``,
    ``ranks_notes()``, ``compile_notes()`` and the limit's ``limit_bytes`` / ``limit_source`` / ``reserve_bytes``):
    :class:`Prober` here, a job per trial in ``batchfit.relaunch``. ``started``: the
    ``time.monotonic()`` the answer's time counts from."""
    _check_callbacks(callback, on_trial_start, on_start)
    grid, chooser = options.grid(), options.make_strategy()
    trials: list[Trial] = []

    def run(batch_size: int, kind: TrialKind, steps: int | None = None) -> Trial:
        if on_trial_start is not None:
            on_trial_start(batch_size, kind)
        # The verification runs as the first steps of a real run do: a fresh optimizer whose
        # state step 1 allocates (with a single step it keeps the warm one, so the state counts).
        fresh = kind == "verify" and (steps or 0) >= 2
        trial = prober.trial(batch_size, steps=steps, kind=kind, fresh_optimizer=fresh)
        trials.append(trial)
        if callback is not None:
            callback(trial)
        return trial

    def out_of_time() -> bool:
        # Every rank must stop at the same point: the first rank out of time stops them all.
        late = options.time_budget is not None and time.monotonic() - started > options.time_budget
        return prober.ranks.any(late) if options.time_budget is not None else False

    in_trial = [False]  # an exception raised while True came from a trial or a callback, not the search

    def oracle(batch_size: int) -> search_mod.Attempt:
        in_trial[0] = True
        trial = run(batch_size, "search")
        in_trial[0] = False
        # The search sees each trial in the unit the budget counts (reserved bytes on CUDA).
        return _verdict(trial, unit)

    with prober:
        budget, unit = prober.budget_bytes, prober.counts
        if on_start is not None:
            on_start(prober.device_info, budget)
        try:
            report = search_mod.search(oracle, grid, chooser, out_of_time, budget_bytes=budget)
        except NothingFitsError as failed:
            if in_trial[0]:
                raise  # the user's callback (or model) raised it: not the search's verdict
            last = trials[-1]
            raise NothingFitsError(
                failed.batch_size, failed.needed_bytes, budget, last.phase, last.message, prober.fixed_advice()
            ) from None
        memory = prober.memory_model(trials)
        safe, verified, safe_notes = _safe_batch(report, trials, memory, budget, options, unit, run)
    throughput = Throughput.of(trials)

    return Result(
        max_batch=report.largest_fit,
        safe_batch=safe,
        best_throughput_batch=throughput.best_batch if throughput else report.largest_fit,
        budget_bytes=budget,
        boundary_reached=report.boundary_reached,
        stop_reason=report.stop_reason,
        non_monotone=search_mod.is_non_monotone([_verdict(t, unit) for t in trials]),
        safe_verified=verified,
        trials=tuple(trials),
        memory=memory,
        device=prober.device_info,
        settings=_settings(options, prober, chooser.name),
        elapsed_s=time.monotonic() - started,
        torch_version=torch.__version__,
        batchfit_version=__version__,
        notes=tuple(
            [
                *prober.notes,
                *prober.compile_notes(trials),
                *_ranks_notes(prober),
                *safe_notes,
                *_trial_notes(trials, report),
                *_equation_notes(memory, report, budget),
                *_throughput_notes(throughput),
            ]
        ),
        budget_counts=unit,
        throughput=throughput,
        world_size=prober.ranks.world_size,
    )


def _check_callbacks(*callbacks: Any) -> None:
    """Name a callback that cannot be called before anything runs."""
    for name, fn in zip(("callback", "on_trial_start", "on_start"), callbacks):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")


def _ranks_notes(prober: Prober) -> list[str]:
    """Say what a batch size means when several ranks probed together."""
    size = prober.ranks.world_size
    if size == 1:
        return []
    return [
        f"probed on {size} ranks together: batch sizes are per rank (the global batch is {size} x that), a size "
        "fits only where it fitted on every rank, peaks are the largest rank's, samples/s are the whole group's "
        "(the slowest rank's step)",
        *prober.ranks_notes(),
    ]


def _verdict(trial: Trial, unit: Unit) -> search_mod.Attempt:
    """A trial as the search sees it: fits or not, and its peaks in the budget's unit."""
    return search_mod.Attempt(trial.batch_size, trial.fits, trial.peak_in(unit), trial.phase_peaks_in(unit))


def _settings(options: Options, prober: Prober, strategy: str) -> Settings:
    return _settings_of(options, prober.limit_bytes, prober.limit_source, prober.reserve_bytes, strategy)


def _settings_of(
    options: Options, limit_bytes: int | None, limit_source: str, reserve_bytes: int, strategy: str
) -> Settings:
    grid = options.grid()
    return Settings(
        mode=options.mode,
        amp=options.amp,
        init_batch=grid.init,
        max_batch=grid.maximum,
        multiple_of=grid.multiple_of,
        steps_per_trial=options.steps_per_trial,
        verify_steps=options.verify_steps,
        headroom=float(options.headroom),
        strategy=strategy,
        memory_limit_bytes=limit_bytes,
        limit_source=limit_source,
        time_budget_s=None if options.time_budget is None else float(options.time_budget),
        reserve_bytes=reserve_bytes,
    )


def _trial_notes(trials: list[Trial], report: search_mod.SearchReport) -> list[str]:
    """What the trials showed that a reader should know: odd memory, leaks, fp16 skips."""
    notes: list[str] = []
    if search_mod.is_non_monotone([search_mod.Attempt(t.batch_size, t.fits) for t in trials]):
        notes.append("memory was not monotone in batch size: a size failed although a larger one fitted")
    notes += [
        f"trial at batch {t.batch_size} left {format_bytes(t.leaked_bytes)} allocated after release"
        for t in trials
        if t.leaked_bytes
    ]
    skipped = sum(t.skipped_steps for t in trials)
    if skipped:
        notes.append(
            f"fp16: the GradScaler skipped {skipped} optimizer step(s) (inf/NaN gradients while its scale came "
            "down); those steps did not count, every trial ran until its optimizer really stepped, so the "
            "optimizer state is in every peak"
        )
    if not report.boundary_reached:
        notes.append(
            f"no size ran out of memory up to {report.largest_fit} ({report.stop_reason}): "
            "the true maximum may be larger"
        )
    return notes


def _equation_notes(memory: MemoryModel | None, report: search_mod.SearchReport, budget: int | None) -> list[str]:
    """Say so when the memory equation calls the size that ran out of memory a fit: then it
    must not be trusted near the boundary (the measured trials are what counts)."""
    failed = report.smallest_fail
    if memory is None or budget is None or failed is None or memory.predict(failed) > budget:
        return []
    return [
        f"the memory equation predicts {format_bytes(memory.predict(failed))} for batch {failed}, within the "
        f"budget, but batch {failed} ran out of memory: do not extrapolate the equation near the boundary"
    ]


def _safe_batch(
    report: search_mod.SearchReport,
    trials: list[Trial],
    memory: MemoryModel | None,
    budget: int | None,
    options: Options,
    unit: Unit,
    run: Callable[[int, TrialKind, int | None], Trial],
) -> tuple[int, bool, list[str]]:
    """The largest size whose peak (in the budget's unit) leaves ``headroom`` of the budget
    free, then verified.

    Candidates: the largest fitting trial whose measured peak is within the target, and the
    memory equation's prediction (which can land between tried sizes). The verification must fit
    *and* leave the headroom (on CUDA reserved memory grows in segments, so a predicted size can
    overshoot); if it does not, step down by the headroom fraction and try again (at most three
    times). If none passes, the largest size that fitted any trial is returned, marked not
    verified, with a note in capitals: never a size that was not run.
    """
    notes: list[str] = []
    grid, headroom, verify_steps = options.grid(), options.headroom, options.verify_steps
    largest = report.largest_fit
    if budget is None:
        safe = largest
    else:
        target = budget * (1 - headroom)
        measured = [
            t.batch_size for t in trials if t.fits and t.peak_in(unit) is not None and t.peak_in(unit) <= target
        ]
        predicted = grid.floor(memory.largest_batch_within(target, ceiling=largest)) if memory else 0
        safe = min(largest, max([*measured, predicted, 0]))
        if safe < grid.init:
            safe = grid.init
            notes.append(f"even batch {grid.init} leaves less than {headroom:.0%} of the budget free")
    if verify_steps == 0:
        return safe, False, notes
    for _ in range(3):
        check = run(safe, "verify", verify_steps)
        peak = check.peak_in(unit)
        if check.fits and (budget is None or peak is None or peak <= budget * (1 - headroom) or safe == grid.init):
            return safe, True, notes
        notes.append(
            f"safe batch {safe} ran out of memory when verified with {verify_steps} steps"
            if not check.fits
            else f"safe batch {safe} used {format_bytes(peak)} when verified, more than the headroom allows"
        )
        lower = max(grid.init, grid.floor(math.floor(safe * (1 - max(headroom, 0.1)))))
        if lower == safe:
            break
        safe = lower
    # Never hand back a size that was not run: the largest one that fitted a trial.
    tried = [t.batch_size for t in trials if t.fits and t.batch_size <= safe]
    fallback = max(tried, default=grid.init)
    notes.append(
        f"NO SAFE BATCH WAS VERIFIED: batch {fallback} is the largest size that fitted a trial below the "
        f"candidates, but it was not verified with {verify_steps} steps; expect out-of-memory errors near it"
    )
    return fallback, False, notes


def _throughput_notes(throughput: Throughput | None) -> list[str]:
    """Say how far the throughput answer can be trusted."""
    if throughput is None or throughput.knee_batch == throughput.best_batch:
        return []
    notes = [
        f"throughput: batch {throughput.knee_batch} reaches {throughput.knee_samples_per_s:,.1f} samples/s, within "
        f"5% of the best measured ({throughput.best_samples_per_s:,.1f} at batch {throughput.best_batch}): "
        "bigger batches hardly pay in speed"
    ]
    if throughput.within_noise:
        notes.append(
            f"throughput: the difference between batch {throughput.best_batch} and {throughput.knee_batch} is within "
            f"the measurement's noise (repeated steps spread by {throughput.spread:.0%})"
        )
    if throughput.single_step_best:
        notes.append(
            f"throughput: the rate of batch {throughput.best_batch} comes from one timed step (a search trial), "
            "which on a GPU also pays for the first use of that shape"
        )
    return notes
