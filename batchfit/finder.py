"""``find()``: the search, run on real trials, assembled into a :class:`Result`.

:class:`Prober` owns the lifetime of a probe: it validates the input, snapshots the user's
model and optimizer, moves the model to the probe device, applies the memory limit, runs
trials on request, and in ``__exit__`` (also on an error or Ctrl-C) undoes all of it and
releases the memory. :func:`find` drives a :class:`Prober` with the pure search from
``search.py``, then picks and verifies a safe batch.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from batchfit import search as search_mod
from batchfit.devices import describe, resolve_device
from batchfit.errors import NothingFitsError
from batchfit.memory import DEFAULT_CPU_FRACTION, CudaMeter, LiveTensorMeter, Meter, available_host_bytes
from batchfit.result import DeviceInfo, MemoryModel, Result, Settings, Trial
from batchfit.state import Snapshot, take
from batchfit.trial import run_trial
from batchfit.units import format_bytes, parse_memory_limit
from batchfit.version import __version__
from batchfit.workload import (
    AMP_DTYPES,
    MODES,
    Workload,
    batch_size_of,
    optimizer_factory,
    tensor_leaves,
    to_device,
    validate_choice,
)

TrialCallback = Callable[[Trial], None]
StartCallback = Callable[[int, str], None]
ProbeStartCallback = Callable[[DeviceInfo, "int | None"], None]

#: Above 65535 rows some CUDA kernels fail with "invalid configuration argument", which is not
#: an out-of-memory; the default ceiling stays below it.
DEFAULT_MAX_BATCH = 32768


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class Prober:
    """Runs trials of one workload on one device, and leaves everything as it found it.

    Use as a context manager::

        with batchfit.Prober(model, sample, memory_limit="8GiB") as prober:
            trial = prober.trial(64)          # a real Trial: fits, peak_bytes, samples_per_s...

    Arguments are those of :func:`batchfit.find` that describe the work and the device.
    """

    def __init__(
        self,
        model: nn.Module,
        sample: Any = None,
        *,
        make_batch: Callable[[int], Any] | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        step_fn: Callable[[nn.Module, Any], Any] | None = None,
        optimizer: Any = None,
        amp: str | None = None,
        mode: str = "train",
        device: str | torch.device | None = None,
        memory_limit: int | float | str | None = None,
        steps_per_trial: int = 3,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if (sample is None) == (make_batch is None):
            raise TypeError(
                "pass exactly one of sample= (one batch; its first dimension is the batch) "
                "or make_batch= (a callable batch_size -> batch)"
                if sample is None
                else "pass either sample or make_batch, not both"
            )
        if make_batch is not None and not callable(make_batch):
            raise TypeError(f"make_batch must be callable, got {type(make_batch).__name__}")
        for name, fn in (("loss_fn", loss_fn), ("step_fn", step_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        if loss_fn is not None and step_fn is not None:
            raise ValueError("pass loss_fn or step_fn, not both (step_fn computes the loss itself)")
        validate_choice("mode", mode, MODES)
        validate_choice("amp", amp, (None, *AMP_DTYPES))
        self.steps_per_trial = _positive_int("steps_per_trial", steps_per_trial)
        self._sample_size = batch_size_of(sample) if sample is not None else None
        self._user_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self._new_optimizer = optimizer_factory(optimizer)
        self.device = resolve_device(device, model)
        self.device_info: DeviceInfo = describe(self.device)
        self._model = model
        self._raw_sample = sample
        self._make_batch = make_batch
        self._loss_fn = loss_fn
        self._step_fn = step_fn
        self._amp = amp
        self.mode = mode
        self.limit_bytes, self.limit_source = self._resolve_limit(memory_limit)
        self.budget_bytes: int | None = None
        self.meter: Meter | None = None
        self.optimizer_state_bytes = 0
        self._workload: Workload | None = None
        self._snapshot: Snapshot | None = None
        self._stack: contextlib.ExitStack | None = None

    def _resolve_limit(self, memory_limit: int | float | str | None) -> tuple[int | None, str]:
        if self.device.type == "cpu":
            available = available_host_bytes()
            if memory_limit is None:
                if available is None:
                    raise ValueError("cannot read the host's available memory: pass memory_limit=")
                return int(available * DEFAULT_CPU_FRACTION), (
                    f"default: {DEFAULT_CPU_FRACTION:.0%} of available host memory"
                )
            return parse_memory_limit(memory_limit, available), "memory_limit"
        if memory_limit is None:
            return None, "device"
        return parse_memory_limit(memory_limit, self.device_info.total_bytes), "memory_limit"

    # lifetime ------------------------------------------------------------------------------------
    def __enter__(self) -> Prober:
        self._snapshot = take(self._model, self._user_optimizer)
        self._stack = contextlib.ExitStack()
        try:
            self._prepare()
        except BaseException:
            self._finish()
            raise
        return self

    def _prepare(self) -> None:
        model = self._model
        with torch.no_grad():
            for param in model.parameters():
                param.grad = None
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.device != self.device:
                    tensor.data = tensor.data.to(self.device)
        model.train(self.mode == "train")
        sample = to_device(self._raw_sample, self.device) if self._raw_sample is not None else None
        self._workload = Workload(
            model=model,
            device=self.device,
            mode=self.mode,
            sample=sample,
            sample_size=self._sample_size,
            make_batch=self._make_batch,
            loss_fn=self._loss_fn,
            step_fn=self._step_fn,
            new_optimizer=self._new_optimizer,
            amp=self._amp,
        )
        if self.mode == "train" and not self._workload.trainable_parameters() and self._step_fn is None:
            raise ValueError(
                "the model has no trainable parameter: a training probe needs one (or use mode='inference')"
            )
        self.meter = self._make_meter(sample)
        assert self._stack is not None
        self._stack.enter_context(self.meter.active())

    def _make_meter(self, sample: Any) -> Meter:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            reachable = free + torch.cuda.memory_reserved(self.device)
            self.budget_bytes = (
                reachable
                if self.limit_bytes is None
                else min(self.limit_bytes, self.device_info.total_bytes or self.limit_bytes)
            )
            return CudaMeter(self.device, self.budget_bytes, self.limit_bytes)
        self.budget_bytes = self.limit_bytes
        return LiveTensorMeter(self.limit_bytes, self.device_info.total_bytes, _live_bytes(self._model, sample))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish()

    def _finish(self) -> None:
        try:
            if self._stack is not None:
                self._stack.close()
        finally:
            self._workload = None
            if self._snapshot is not None:
                self._snapshot.restore()
                self._snapshot = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    # trials ----------------------------------------------------------------------------------------
    def trial(self, batch_size: int, steps: int | None = None, kind: str = "search") -> Trial:
        """Run one real trial at ``batch_size`` (``steps`` defaults to ``steps_per_trial``)."""
        if self._workload is None or self.meter is None:
            raise RuntimeError("Prober.trial() needs an active probe: use 'with Prober(...) as p:'")
        batch_size = _positive_int("batch_size", batch_size)
        steps = self.steps_per_trial if steps is None else _positive_int("steps", steps)
        run = run_trial(self._workload, self.meter, batch_size, steps, kind)
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, run.optimizer_state_bytes)
        return run.trial

    def memory_parts(self) -> tuple[int, int]:
        """(weights bytes, gradient bytes) of the model as probed."""
        weights = sum(p.numel() * p.element_size() for p in self._model.parameters())
        grads = sum(p.numel() * p.element_size() for p in self._model.parameters() if p.requires_grad)
        return weights, grads if self.mode == "train" else 0


def _live_bytes(model: nn.Module, sample: Any) -> int:
    """Bytes of the distinct storages the probe starts with: weights, buffers, the sample."""
    storages: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for _, t in tensor_leaves(sample, "sample")] if sample is not None else []
    for tensor in tensors:
        if tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def find(
    model: nn.Module,
    sample: Any = None,
    *,
    make_batch: Callable[[int], Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    step_fn: Callable[[nn.Module, Any], Any] | None = None,
    optimizer: Any = None,
    amp: str | None = None,
    mode: str = "train",
    device: str | torch.device | None = None,
    memory_limit: int | float | str | None = None,
    headroom: float = 0.10,
    init_batch: int | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    multiple_of: int = 1,
    steps_per_trial: int = 3,
    verify_steps: int = 5,
    strategy: str | search_mod.Strategy = "interpolate",
    time_budget: float | None = None,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
) -> Result:
    """Find the largest batch that trains, a safe batch with headroom, and the fastest batch.

    Runs real steps (forward, loss, backward, optimizer step; forward only with
    ``mode="inference"``) at growing batch sizes until one runs out of memory, then
    binary-searches the boundary. The model, its buffers, train/eval flags, gradients, the
    given optimizer and the RNG state are restored exactly afterwards, whatever happens.

    Args:
        model: the ``nn.Module`` to probe.
        sample: one batch as the model takes it (tensor -> ``model(x)``, tuple/list ->
            ``model(*x)``, mapping -> ``model(**x)``); batches are built by repeating its rows.
        make_batch: instead of ``sample``, a callable ``batch_size -> batch``.
        loss_fn: ``(output, batch) -> loss``; default: ``output.loss`` or the output's mean.
        step_fn: ``(model, batch) -> loss``, replaces forward and loss entirely.
        optimizer: ``None`` (a fresh AdamW), an optimizer (a fresh one of its class and
            hyperparameters is used; yours is never stepped) or a factory ``params -> optimizer``.
        amp: ``"bf16"`` or ``"fp16"`` to run under autocast (fp16 with a grad scaler).
        mode: ``"train"`` or ``"inference"`` (forward only, under ``torch.inference_mode``).
        device: where to probe; default: where the model is. The model comes back afterwards.
        memory_limit: bytes, a size (``"24GiB"``) or a fraction of the device's memory (CUDA:
            its total; CPU: what is available at the start). On CPU the default is half the
            available host memory, and the limit counts live tensor bytes.
        headroom: the fraction of the budget the safe batch leaves free.
        init_batch: the first size tried. Default: 2, or ``multiple_of`` when that is larger.
            Batch 1 is skipped by default because BatchNorm cannot train on one sample
            ("Expected more than 1 value per channel"); pass ``init_batch=1`` to include it.
        max_batch: the largest size tried.
        multiple_of: only multiples of this are tried (e.g. 8 for tensor cores).
        steps_per_trial: steps per size; step 1 warms up, steps 2..N are timed.
        verify_steps: steps run at the safe batch to check it (0 skips the check).
        strategy: ``"interpolate"`` (default: aims at the size where the measured memory lines
            meet the budget, bracketed so it stays exact) or ``"binary"`` (plain doubling and
            bisection), or a strategy object (see ``batchfit.search.Strategy``).
        time_budget: seconds after which no new search trial starts.
        callback: called with every finished :class:`Trial` (search and verification).
        on_trial_start: called with ``(batch_size, kind)`` before each trial.
        on_start: called once with ``(device_info, budget_bytes)`` when the probe is set up and
            before the first trial, so a front end can draw memory against the budget from the
            start (on CUDA without a limit the budget is only known then).

    Raises:
        NothingFitsError: even ``init_batch`` runs out of memory.
        TypeError, ValueError: bad arguments, with a message naming the problem.
        Any exception from the model that is not an out-of-memory, unchanged, with a note that
        names the batch size.
    """
    started = time.monotonic()
    multiple_of = _positive_int("multiple_of", multiple_of)
    if init_batch is None:
        # 2 rather than 1 (BatchNorm cannot train on one sample), but never above max_batch;
        # a max_batch of the wrong type is left for Grid to name.
        init_batch = max(multiple_of, 2)
        if multiple_of == 1 and isinstance(max_batch, int) and max_batch < init_batch:
            init_batch = 1
    grid = search_mod.Grid(
        init=init_batch,
        maximum=max_batch,
        multiple_of=multiple_of,
    )
    chooser = search_mod.make_strategy(strategy)
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
    verify_steps = _positive_int("verify_steps", verify_steps, minimum=0)
    if time_budget is not None and (not isinstance(time_budget, (int, float)) or time_budget <= 0):
        raise ValueError(f"time_budget must be a positive number of seconds, got {time_budget!r}")
    for name, fn in (("callback", callback), ("on_trial_start", on_trial_start), ("on_start", on_start)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")

    prober = Prober(
        model,
        sample,
        make_batch=make_batch,
        loss_fn=loss_fn,
        step_fn=step_fn,
        optimizer=optimizer,
        amp=amp,
        mode=mode,
        device=device,
        memory_limit=memory_limit,
        steps_per_trial=steps_per_trial,
    )
    trials: list[Trial] = []

    def run(batch_size: int, kind: str, steps: int | None = None) -> Trial:
        if on_trial_start is not None:
            on_trial_start(batch_size, kind)
        trial = prober.trial(batch_size, steps=steps, kind=kind)
        trials.append(trial)
        if callback is not None:
            callback(trial)
        return trial

    def out_of_time() -> bool:
        return time_budget is not None and time.monotonic() - started > time_budget

    with prober:
        budget = prober.budget_bytes
        if on_start is not None:
            on_start(prober.device_info, budget)
        try:
            report = search_mod.search(lambda b: run(b, "search"), grid, chooser, out_of_time, budget_bytes=budget)
        except NothingFitsError as failed:
            last = trials[-1]
            raise NothingFitsError(failed.batch_size, failed.needed_bytes, budget, last.phase, last.message) from None
        weights, grads = prober.memory_parts()
        memory = MemoryModel.fit(trials, weights, grads, prober.optimizer_state_bytes)
        safe, verified, safe_notes = _safe_batch(report, trials, memory, budget, headroom, grid, verify_steps, run)

    notes = list(safe_notes)
    non_monotone = search_mod.is_non_monotone([search_mod.Attempt(t.batch_size, t.fits) for t in trials])
    if non_monotone:
        notes.append("memory was not monotone in batch size: a size failed although a larger one fitted")
    notes += [
        f"trial at batch {t.batch_size} left {format_bytes(t.leaked_bytes)} allocated after release"
        for t in trials
        if t.leaked_bytes
    ]
    if not report.boundary_reached:
        notes.append(
            f"no size ran out of memory up to {report.largest_fit} ({report.stop_reason}): "
            "the true maximum may be larger"
        )
    settings = Settings(
        mode=mode,
        amp=amp,
        init_batch=grid.init,
        max_batch=grid.maximum,
        multiple_of=grid.multiple_of,
        steps_per_trial=prober.steps_per_trial,
        verify_steps=verify_steps,
        headroom=float(headroom),
        strategy=chooser.name,
        memory_limit_bytes=prober.limit_bytes,
        limit_source=prober.limit_source,
        time_budget_s=None if time_budget is None else float(time_budget),
    )
    return Result(
        max_batch=report.largest_fit,
        safe_batch=safe,
        best_throughput_batch=_fastest(trials, report.largest_fit),
        budget_bytes=budget,
        boundary_reached=report.boundary_reached,
        stop_reason=report.stop_reason,
        non_monotone=non_monotone,
        safe_verified=verified,
        trials=tuple(trials),
        memory=memory,
        device=prober.device_info,
        settings=settings,
        elapsed_s=time.monotonic() - started,
        torch_version=torch.__version__,
        batchfit_version=__version__,
        notes=tuple(notes),
    )


def _safe_batch(
    report: search_mod.SearchReport,
    trials: list[Trial],
    memory: MemoryModel | None,
    budget: int | None,
    headroom: float,
    grid: search_mod.Grid,
    verify_steps: int,
    run: Callable[[int, str, int | None], Trial],
) -> tuple[int, bool, list[str]]:
    """The largest size whose peak leaves ``headroom`` of the budget free, then verified.

    Candidates: the largest fitting trial whose measured peak is within the target, and the
    memory equation's prediction (which can land between tried sizes). If the verification
    run fails, step down by the headroom fraction and try again (at most three times).
    """
    notes: list[str] = []
    largest = report.largest_fit
    if budget is None:
        safe = largest
    else:
        target = budget * (1 - headroom)
        measured = [t.batch_size for t in trials if t.fits and t.peak_bytes is not None and t.peak_bytes <= target]
        predicted = grid.floor(memory.largest_batch_within(target, ceiling=largest)) if memory else 0
        safe = min(largest, max([*measured, predicted, 0]))
        if safe < grid.init:
            safe = grid.init
            notes.append(f"even batch {grid.init} leaves less than {headroom:.0%} of the budget free")
    if verify_steps == 0:
        return safe, False, notes
    for _ in range(3):
        if run(safe, "verify", verify_steps).fits:
            return safe, True, notes
        notes.append(f"safe batch {safe} ran out of memory when verified with {verify_steps} steps")
        lower = max(grid.init, grid.floor(math.floor(safe * (1 - max(headroom, 0.1)))))
        if lower == safe:
            break
        safe = lower
    return safe, False, notes


def _fastest(trials: list[Trial], fallback: int) -> int:
    timed = [t for t in trials if t.fits and t.samples_per_s is not None]
    if not timed:
        return fallback
    return max(timed, key=lambda t: t.samples_per_s or 0.0).batch_size
