"""One trial: build a batch of size b, run real steps, time them, measure memory, clean up.

The code is shaped around one trap: an exception's traceback holds the frames of the step,
and the frames hold the batch, the activations and the loss. `_run_steps` keeps every
tensor in its own frame and returns only plain data, and the OOM is turned into a record
inside the ``except`` block, so when the function returns nothing of the trial is referenced
any more and `Meter.release` can really give the memory back.

Two more rules shape the steps. *Synchronise only around timed steps*: the allocator's
statistics are read on the host, so phases need no synchronisation, and every extra one makes a
launch-bound batch look slow. *Count only real optimizer steps*: with fp16 a ``GradScaler``
skips ``optimizer.step()`` when the gradients overflow, and AdamW allocates its moments inside
``step()``; a trial whose steps were all skipped would "fit" without the optimizer state. So a
skipped step does not count: the trial runs on (the scaler halves its scale each time) until
``steps`` real optimizer steps ran, at most `MAX_SKIPPED_STEPS` extra, and the scale
reached is handed to the next trial so that only the first trial pays for finding it.

*Keep the optimizer between trials.* Its state (AdamW's two moments) does not depend on the
batch size, and a real run holds it for good from its first step on. A probe that gives every
trial a fresh optimizer needs two steps per trial to see the steady peak (step 1 allocates the
state, step 2 runs with it live); the prober hands the optimizer of the last trial to the next,
so after the first trial one step gives the same peak at half the price. A trial reports
whether its optimizer's state is complete (`TrialRun.optimizer`), and the bytes it holds
are not counted as a leak.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from batchfit.backends import Meter, is_device_failure, is_oom, is_sticky_device_error
from batchfit.distributed import PeerOutOfMemory, Solo
from batchfit.errors import (
    DeviceFailedError,
    NoOptimizerStepError,
    RankFailedError,
    RanksTimeoutError,
    annotate,
    first_line,
)
from batchfit.probe.generate_step import kv_bytes_per_token
from batchfit.probe.workload import Workload
from batchfit.report import Phase, Trial, TrialKind

#: Steps a trial may run beyond ``steps`` while a ``GradScaler`` skips the optimizer step. The
#: scale starts at 2**16 and halves on every skip, so 24 skips reach 2**-8: gradients that
#: still overflow there are inf or NaN whatever the scale.
MAX_SKIPPED_STEPS = 24
#: The steps a replay of a fresh process runs at least (`run_trial`'s ``settle``): step 1 allocates the
#: optimizer state, step 2 is the first with it live, step 3 the first whose cache step 2 shaped.
REPLAY_STEPS = 3
#: The most steps a replay runs while the allocator's layout at the end of a step still changes.
SETTLE_LIMIT = 10


@dataclass(frozen=True)
class TrialRun:
    """A finished trial, what the first real optimizer step allocated for optimizer state, the
    ``GradScaler`` scale the trial ended with (``None`` without fp16), and the optimizer to hand
    to the next trial: one whose state is complete (it has stepped), else ``None``."""

    trial: Trial
    optimizer_state_bytes: int
    grad_scale: float | None = None
    optimizer: torch.optim.Optimizer | None = None
    #: Whether the training step kept the model's output through backward (``Workload.forward``);
    #: ``None`` when no training forward ran.
    output_kept: bool | None = None


@dataclass
class _Progress:
    phase: Phase = "batch"
    steps: int = 0
    skipped: int = 0
    optimizer_state_bytes: int = 0
    grad_scale: float | None = None
    optimizer: torch.optim.Optimizer | None = None
    #: Whether ``optimizer`` holds its complete state (it stepped, here or in an earlier trial).
    optimizer_ready: bool = False
    output_kept: bool | None = None
    kv_bytes_per_token: int | None = None


def run_trial(
    workload: Workload,
    meter: Meter,
    batch_size: int,
    steps: int,
    kind: TrialKind = "search",
    grad_scale: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    ranks: Solo | None = None,
    plain_from: int | None = None,
    settle: bool = False,
) -> TrialRun:
    """Run ``steps`` real steps at ``batch_size`` and return the record.

    Out-of-memory errors become a failed [`Trial`][batchfit.Trial]; any other exception propagates
    unchanged, with a note naming the batch size and phase. ``grad_scale``: the fp16 scale to
    start from (the previous trial's), ``None`` for the ``GradScaler`` default. ``optimizer``:
    one that already stepped in an earlier trial (its state is live), ``None`` for a fresh one.
    ``ranks``: the processes that run the trial together; they meet after every phase
    (``batchfit.distributed.ranks``), so an out-of-memory on one fails the trial on all. The record is
    this rank's: `Solo.combine` makes the group's. ``plain_from``: the steps from this one on (0-based)
    run without the meter's per-operation bookkeeping and alone are timed (`Meter.unobserved`).
    ``settle``: a replay of a fresh process (`Meter.fresh_process`): at least `REPLAY_STEPS` steps, and
    more (up to `SETTLE_LIMIT`) while the allocator's layout at the end of a step still changes.

    Steps that ran without an out-of-memory error can still not fit by the allocator's rule
    (`Meter.refusal`: on CUDA's native allocator, a step that needed the allocator to flush its cache at
    the cap): then the trial failed, with the reason as its message.
    """
    ranks = ranks if ranks is not None else Solo()
    if settle:
        steps = max(steps, REPLAY_STEPS)
    before = meter.allocated_bytes()
    meter.begin_trial()
    warm = optimizer is not None
    progress = _Progress(grad_scale=grad_scale, optimizer=optimizer, optimizer_ready=warm)
    times: list[float] = []
    failure: tuple[str, tuple[int | None, int | None]] | None = None
    # A probe started under torch.no_grad() or inference_mode() still trains for real.
    with meter.tracking(), torch.inference_mode(False), torch.enable_grad(), ranks.deferred_sync(workload.model):
        try:
            _run_steps(workload, meter, batch_size, steps, progress, times, ranks, plain_from, settle)
        except PeerOutOfMemory as exc:  # another rank ran out of memory: this trial failed too
            failure = (str(exc), (None, None))
        except (RankFailedError, RanksTimeoutError):
            raise  # about another rank, and says so
        except Exception as exc:  # KeyboardInterrupt passes untouched
            if is_oom(exc):
                failure = (first_line(exc), meter.failure_bytes(str(exc)))
            elif is_sticky_device_error(exc):
                raise DeviceFailedError(
                    f"the device failed at batch size {batch_size} during {progress.phase} and its "
                    f"context is no longer usable: {first_line(exc)}"
                ) from exc
            else:
                annotate(exc, f"batchfit: raised during {progress.phase} of a trial at batch size {batch_size}")
                raise
        facts = meter.trial_facts()  # while the steps' segments are still held
    refused = meter.refusal() if failure is None else None
    if refused is not None:
        progress.phase = refused[0]  # type: ignore[assignment]  (a phase name the meter recorded)
    kept = progress.optimizer if progress.optimizer_ready else None
    progress.optimizer = None
    try:
        if failure is not None and progress.phase == "backward":
            _flush_autograd(workload.device)
        _drop_grads(workload)
        # The state of an optimizer made here and kept for the next trial is no leak.
        kept_bytes = state_bytes(kept, meter) if kept is not None and not warm else 0
        meter.release(target_bytes=before + kept_bytes)
        leaked = max(0, meter.allocated_bytes() - before - kept_bytes)
    except Exception as exc:
        # A kernel's fault surfaces at the next call that waits for the device, and freeing
        # memory is one: the trial's error, found late. The device is not usable any more.
        if is_device_failure(exc):
            raise DeviceFailedError(
                f"the device failed at batch size {batch_size} (found while releasing the trial's memory) and its "
                f"context is no longer usable: {first_line(exc)}"
            ) from exc
        raise
    phase_peaks = _ordered(meter.phase_peaks())
    phase_reserved = _ordered(meter.phase_reserved_peaks())
    if refused is not None:  # it needed at least what its steps reached
        peaks = (max((b for _, b in phase_peaks), default=None), max((b for _, b in phase_reserved), default=None))
        failure = (refused[1], peaks)
    common = {
        "batch_size": batch_size,
        "kind": kind,
        "phase_peaks": phase_peaks,
        "phase_reserved_peaks": phase_reserved,
        "steps": progress.steps,
        "skipped_steps": progress.skipped,
        "leaked_bytes": leaked,
        "allocator": facts,
        "replay": settle,
    }
    if failure is not None:
        message, (needed, needed_reserved) = failure
        trial = Trial(
            fits=False,
            phase=progress.phase,
            peak_bytes=needed,
            reserved_peak_bytes=needed_reserved,
            message=message,
            **common,
        )
        return TrialRun(trial, progress.optimizer_state_bytes, progress.grad_scale, kept, progress.output_kept)
    step_time = statistics.median(times) if times else None
    trial = Trial(
        fits=True,
        peak_bytes=max((b for _, b in phase_peaks), default=None),
        reserved_peak_bytes=max((b for _, b in phase_reserved), default=None),
        step_time_s=step_time,
        samples_per_s=batch_size / step_time if step_time else None,
        step_times_s=tuple(times),
        kv_bytes_per_token=progress.kv_bytes_per_token,
        **common,
    )
    return TrialRun(trial, progress.optimizer_state_bytes, progress.grad_scale, kept, progress.output_kept)


def _ordered(peaks: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple((phase, peaks[phase]) for phase in ("batch", "forward", "backward", "step") if phase in peaks)


def _run_steps(
    workload: Workload,
    meter: Meter,
    batch_size: int,
    steps: int,
    progress: _Progress,
    times: list[float],
    ranks: Solo,
    plain_from: int | None = None,
    settle: bool = False,
) -> None:
    """The steps themselves, every tensor of the trial in this frame (see the module docs). Step 1
    warms up (and allocates optimizer state); steps 2..N are timed, with the device synchronised at
    their start and end only. With a single step, that step is timed. ``plain_from``: the steps from
    this one on run without the meter's per-operation bookkeeping (`Meter.unobserved`), as a plain
    loop runs them, and alone are timed; the steps before them measured their memory. Training runs until `steps`
    steps really stepped the optimizer. Every phase ends in a meeting of the ranks (a no-op for one
    process). One function, not one per loop: the path from `find` to the model stays short."""
    if workload.mode == "eval" and progress.optimizer is None:
        # Evaluation runs beside the training state: made first (its set-up's transient gradients
        # are no part of the evaluation step, so the trial's peaks start after it).
        progress.phase = "step"
        with ranks.meet("step", batch_size):
            progress.optimizer = _training_state(workload)
        progress.optimizer_ready = True
        progress.optimizer_state_bytes = state_bytes(progress.optimizer, meter)
        meter.begin_trial()
    progress.phase = "batch"
    with ranks.meet("batch", batch_size):
        with meter.phase("batch"):
            batch = workload.build_batch(batch_size)
        if workload.mode == "train" and progress.optimizer is None:
            progress.optimizer = workload.new_optimizer(workload.trainable_parameters())
    if workload.mode != "train":
        # Evaluation under no_grad, as evaluation loops run; inference and generation under inference_mode.
        no_grad = torch.no_grad if workload.mode == "eval" else torch.inference_mode
        for index in range(steps):
            meter.checkpoint()
            with _timed(meter, times, index > 0 or steps == 1):
                progress.phase = "forward"
                with ranks.meet("forward", batch_size), meter.phase("forward"), no_grad():
                    output, loss = workload.forward(batch)
                    if workload.mode == "generate":
                        progress.kv_bytes_per_token = kv_bytes_per_token(output)
                    del output, loss
            progress.steps += 1
        return
    optimizer = progress.optimizer
    assert optimizer is not None
    stepped: list[int] = []  # one entry per optimizer.step() that really ran
    hook = optimizer.register_step_post_hook(lambda *_: stepped.append(1))
    scaler = workload.grad_scaler(progress.grad_scale)
    layouts: list[tuple[int, ...]] = []  # the allocator's layout after each step, while settling
    try:
        while progress.steps < steps or (settle and _unsettled(layouts) and progress.steps < SETTLE_LIMIT):
            plain = plain_from is not None and progress.steps >= plain_from
            timed = (bool(stepped) or steps == 1) and (plain_from is None or plain)
            unobserved = meter.unobserved() if plain else contextlib.nullcontext()
            with unobserved, _timed(meter, times, timed) as record:
                ran_before = len(stepped)
                # The output forward hands back stays alive until the step ends, as in the loop it
                # stands for (None where that loop frees it before backward: Workload.forward).
                # Between the phases a Ctrl-C deferred by the probe surfaces (meter.checkpoint),
                # and the ranks meet. Under DDP, backward runs without its all-reduce
                # (Solo.deferred_sync), and the gradients are all-reduced at the start of the step
                # phase, once every rank's backward worked.
                progress.phase = "forward"
                meter.checkpoint()
                with ranks.meet("forward", batch_size), meter.phase("forward"):
                    output, loss = workload.forward(batch)
                assert loss is not None
                progress.output_kept = output is not None
                progress.phase = "backward"
                meter.checkpoint()
                with ranks.meet("backward", batch_size), meter.phase("backward"):
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                progress.phase = "step"
                meter.checkpoint()
                with ranks.meet("step", batch_size), meter.phase("step"):
                    ranks.sync_gradients(workload.model, "step", batch_size)
                    if scaler is not None:
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                del output, loss
                record.keep = len(stepped) > ran_before
            if len(stepped) == ran_before:
                progress.skipped += 1
                if progress.skipped > MAX_SKIPPED_STEPS:
                    raise NoOptimizerStepError(
                        f"the optimizer never stepped at batch size {batch_size}: the GradScaler skipped "
                        f"{progress.skipped} steps in a row (inf/NaN fp16 gradients); check the loss, or probe "
                        "with amp='bf16' (see docs/concepts/one-trial.md#one-trial)"
                    )
                continue
            progress.steps += 1
            progress.optimizer_ready = True
            if progress.steps == 1:
                progress.optimizer_state_bytes = state_bytes(optimizer, meter)
            if settle:
                layouts.append(meter.layout())
    finally:
        hook.remove()
        if scaler is not None:  # read once (it synchronises), for the next trial to start from
            with contextlib.suppress(Exception):  # a failed device must not hide the real error
                progress.grad_scale = float(scaler.get_scale())


def _unsettled(layouts: list[tuple[int, ...]]) -> bool:
    """Whether the allocator's layout still changed over the last step."""
    return len(layouts) < 2 or layouts[-1] != layouts[-2]


class _Timing:
    keep = True


@contextlib.contextmanager
def _timed(meter: Meter, times: list[float], timed: bool) -> Iterator[_Timing]:
    """Time the code inside between two synchronisations when `timed`; the caller may clear
    `keep` (a step whose optimizer update was skipped is not a step's time)."""
    record = _Timing()
    if not timed:
        yield record
        return
    meter.synchronize()
    start = time.perf_counter()
    yield record
    meter.synchronize()
    if record.keep:
        times.append(time.perf_counter() - start)


def _training_state(workload: Workload) -> torch.optim.Optimizer:
    """A fresh optimizer with its state allocated, as training leaves it when evaluation runs mid-way: one
    step on zero gradients (AdamW's moments made), then the gradients freed (``zero_grad``'s default)."""
    params = workload.trainable_parameters()
    optimizer = workload.new_optimizer(params)
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def state_bytes(optimizer: torch.optim.Optimizer, meter: Meter) -> int:
    """The memory the optimizer's state holds, as the meter counts it."""
    return meter.held_bytes(
        value for entries in optimizer.state.values() for value in entries.values() if isinstance(value, torch.Tensor)
    )


def _flush_autograd(device: torch.device) -> None:
    """Run a tiny backward after an OOM in backward. An exception raised inside the autograd
    engine can leave the failed graph referenced until the next ``backward()`` on the same engine
    thread (pytorch #82218; seen with CPU autocast, where the OOM hit a ``_to_copy`` in backward
    and 100 MiB stayed live). An accelerator's backward runs on that device's own engine thread,
    which a CPU backward never reaches, so the flush runs on the trial's ``device`` (and on the CPU,
    whose thread ran the CPU part); a leak left would show in ``Trial.leaked_bytes`` and shrink
    later trials."""
    with torch.enable_grad():
        for target in dict.fromkeys((torch.device("cpu"), device)):
            seed = torch.zeros((), device=target, requires_grad=True)
            (seed * 1.0).backward()


def _drop_grads(workload: Workload) -> None:
    for param in workload.model.parameters():
        param.grad = None
