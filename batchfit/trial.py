"""One trial: build a batch of size b, run real steps, time them, measure memory, clean up.

The code is shaped around one trap: an exception's traceback holds the frames of the step,
and the frames hold the batch, the activations and the loss. :func:`_run_steps` keeps every
tensor in its own frame and returns only plain data, and the OOM is turned into a record
inside the ``except`` block, so when the function returns nothing of the trial is referenced
any more and :meth:`Meter.release` can really give the memory back.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from batchfit.errors import DeviceFailedError
from batchfit.memory import Meter
from batchfit.oom import annotate, first_line, is_oom, is_sticky_device_error
from batchfit.result import Trial
from batchfit.workload import Workload


@dataclass(frozen=True)
class TrialRun:
    """A finished trial plus what the first training step allocated for optimizer state."""

    trial: Trial
    optimizer_state_bytes: int


@dataclass
class _Progress:
    phase: str = "batch"
    steps: int = 0
    optimizer_state_bytes: int = 0


def run_trial(workload: Workload, meter: Meter, batch_size: int, steps: int, kind: str = "search") -> TrialRun:
    """Run ``steps`` real steps at ``batch_size`` and return the record.

    Out-of-memory errors become a failed :class:`Trial`; any other exception propagates
    unchanged, with a note naming the batch size and phase.
    """
    before = meter.allocated_bytes()
    meter.begin_trial()
    progress = _Progress()
    times: list[float] = []
    failure: tuple[str, int | None] | None = None
    with meter.tracking():
        try:
            _run_steps(workload, meter, batch_size, steps, progress, times)
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
    _drop_grads(workload)
    meter.release(target_bytes=before)
    leaked = max(0, meter.allocated_bytes() - before)
    peaks = meter.phase_peaks()
    phase_peaks = tuple((phase, peaks[phase]) for phase in ("batch", "forward", "backward", "step") if phase in peaks)
    if failure is not None:
        message, needed = failure
        trial = Trial(
            batch_size=batch_size,
            fits=False,
            kind=kind,
            phase=progress.phase,
            peak_bytes=needed,
            phase_peaks=phase_peaks,
            steps=progress.steps,
            leaked_bytes=leaked,
            message=message,
        )
        return TrialRun(trial, progress.optimizer_state_bytes)
    step_time = statistics.median(times) if times else None
    trial = Trial(
        batch_size=batch_size,
        fits=True,
        kind=kind,
        peak_bytes=max(peaks.values()) if peaks else None,
        phase_peaks=phase_peaks,
        step_time_s=step_time,
        samples_per_s=batch_size / step_time if step_time else None,
        steps=progress.steps,
        leaked_bytes=leaked,
    )
    return TrialRun(trial, progress.optimizer_state_bytes)


def _run_steps(
    workload: Workload,
    meter: Meter,
    batch_size: int,
    steps: int,
    progress: _Progress,
    times: list[float],
) -> None:
    """The steps themselves. Step 1 warms up (and allocates optimizer state); steps 2..N are
    timed with device synchronisation. With a single step, that step is timed."""
    progress.phase = "batch"
    with meter.phase("batch"):
        batch = workload.build_batch(batch_size)
    training = workload.mode == "train"
    optimizer = workload.new_optimizer(workload.trainable_parameters()) if training else None
    scaler = workload.grad_scaler() if training else None
    for index in range(steps):
        meter.synchronize()
        start = time.perf_counter()
        if training:
            assert optimizer is not None
            _train_step(workload, meter, batch, optimizer, scaler, progress)
        else:
            progress.phase = "forward"
            with meter.phase("forward"), torch.inference_mode():
                output, _ = workload.forward(batch)
                del output
        meter.synchronize()
        progress.steps += 1
        if index == 0 and optimizer is not None:
            progress.optimizer_state_bytes = _state_bytes(optimizer)
        if index > 0 or steps == 1:
            times.append(time.perf_counter() - start)


def _train_step(
    workload: Workload,
    meter: Meter,
    batch: object,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    progress: _Progress,
) -> None:
    # The output stays alive until the step ends, as in an ordinary training loop.
    progress.phase = "forward"
    with meter.phase("forward"):
        output, loss = workload.forward(batch)
    assert loss is not None
    progress.phase = "backward"
    with meter.phase("backward"):
        (scaler.scale(loss) if scaler is not None else loss).backward()
    progress.phase = "step"
    with meter.phase("step"):
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del output, loss


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for entries in optimizer.state.values():
        for value in entries.values():
            if isinstance(value, torch.Tensor):
                total += value.untyped_storage().nbytes()
    return total


def _drop_grads(workload: Workload) -> None:
    for param in workload.model.parameters():
        param.grad = None
