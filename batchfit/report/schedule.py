"""A run's batch schedule, pure: where it stands, every change and why, the exports.

Pure Python (no torch): a meter (``batchfit.probe.noise_meter``, ``batchfit.probe.layernorm_meter``)
hands over each metered step's squared norms as a `Window`,
[`BatchSchedule`][batchfit.probe.batch_schedule.BatchSchedule] applies what `ScheduleState.after_step`
decides by its [`ScheduleRule`][batchfit.report.schedule_rule.ScheduleRule] (the rule, and why it is
what it is: ``batchfit.report.schedule_rule``), and the arithmetic can be tested exhaustively.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from batchfit.report.codec import Batch, Count, JsonRecord, Range
from batchfit.report.noise import NoiseScale, window_estimates
from batchfit.report.schedule_rule import LR_EXPONENT, ScheduleRule


@dataclass(frozen=True)
class ScheduleChange(JsonRecord):
    """One change of the batch: from which step, to what, why.

    Attributes:
        step: optimizer steps done before the new batch trains.
        samples: samples trained before it (all ranks).
        accumulation: micro-batches per step from here on.
        global_batch: ``micro_batch x accumulation x world_size``.
        lr_factor: the learning rate's multiplier relative to the run's start, from here on.
        noise_scale: the smoothed ``B_simple`` when decided (``None`` for an open-loop policy).
        reason: one sentence, for the log.
    """

    NOUN: ClassVar[str] = "batch schedule change"

    step: Count
    samples: Count
    accumulation: Batch
    global_batch: Batch
    lr_factor: Annotated[float, Range(0)]
    noise_scale: Annotated[float, Range(0)] | None
    reason: str


@dataclass(frozen=True)
class Window:
    """One metered step's squared gradient norms, in the units of a micro-batch's mean loss.

    Attributes:
        small: the mean over micro-batches of ``|g_b|^2`` (``b = small_batch`` rows each).
        big: ``|g_B|^2`` of the batch they make together (``B = big_batch`` rows).
        small_batch, big_batch: ``b < B``.
    """

    small: float
    big: float
    small_batch: int
    big_batch: int

    @property
    def finite(self) -> bool:
        """Whether both norms are finite (an overflowed fp16 step's are not: the window is dropped)."""
        return math.isfinite(self.small) and math.isfinite(self.big) and self.small_batch < self.big_batch


@dataclass(frozen=True)
class NoisePoint(JsonRecord):
    """A metered step: the smoothed noise scale after it (for the picture and the log)."""

    NOUN: ClassVar[str] = "noise point"

    step: Count
    samples: Count
    global_batch: Batch
    b_simple: Annotated[float, Range(0)] | None


#: Windows `ScheduleState.noise_scale` bootstraps from: the last this many at the current batch sizes.
RECENT = 32


@dataclass(frozen=True)
class ScheduleState(JsonRecord):
    """Where a run stands: what a checkpoint saves and a resumed run must agree with.

    Attributes:
        rule: the rule the run trains under.
        step, samples: optimizer steps and samples (all ranks) done.
        accumulation: micro-batches per step now.
        lr_factor: the learning rate's multiplier relative to the start.
        gradient_sq, trace_sigma: the moving averages of ``|G|^2`` and ``tr(Sigma)`` (``None``
            before the first window).
        windows, settled: metered windows in all, and since the last change.
        last_change: the step of the last change (0 at the start).
        changes: every change, in order.
        noise: every metered step's smoothed noise scale, in order.
        recent: the last `RECENT` windows at the current batch sizes, as ``(small, big, b, B)``: what
            `noise_scale` bootstraps its interval from.
    """

    SCHEMA: ClassVar[str] = "batchfit.schedule/1"
    NOUN: ClassVar[str] = "batch schedule"

    rule: ScheduleRule
    step: Count = 0
    samples: Count = 0
    accumulation: Batch = 1
    lr_factor: Annotated[float, Range(0)] = 1.0
    gradient_sq: float | None = None
    trace_sigma: float | None = None
    windows: Count = 0
    settled: Count = 0
    last_change: Count = 0
    changes: tuple[ScheduleChange, ...] = ()
    noise: tuple[NoisePoint, ...] = ()
    recent: tuple[tuple[float, float, Batch, Batch], ...] = ()  # float: a sum grown by dot products may round below 0

    @classmethod
    def start(cls, rule: ScheduleRule) -> ScheduleState:
        """The state before the first step."""
        return cls(rule=rule, accumulation=rule.accumulation)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step now, on all ranks."""
        return self.rule.global_batch(self.accumulation)

    @property
    def b_simple(self) -> float | None:
        """The smoothed noise scale, ``None`` before a window or while ``|G|^2`` is not above zero."""
        if self.gradient_sq is None or self.trace_sigma is None or self.gradient_sq <= 0:
            return None
        return max(0.0, self.trace_sigma) / self.gradient_sq

    def meters(self, step: int | None = None) -> bool:
        """Whether the step about to run (by default the next) is metered."""
        return self.rule.policy == "noise" and (self.step if step is None else step) % self.rule.every == 0

    def after_step(
        self, window: Window | None = None, *, micro_batches: int | None = None, hold: bool = False
    ) -> ScheduleState:
        """The state after one optimizer step at the current batch.

        Args:
            window: its squared norms when metered; one that is not finite (or has no second batch
                size) is dropped.
            micro_batches: the micro-batches it really took, when fewer than ``accumulation`` (an
                epoch's short last step): its samples are counted, its window dropped.
            hold: decide no change after this step (a trainer that can change the accumulation only
                at some steps: the rule decides again at the next step not held).
        """
        taken = self.accumulation if micro_batches is None else min(micro_batches, self.accumulation)
        state = replace(self, step=self.step + 1, samples=self.samples + taken * self.rule.rows_per_accumulation)
        if window is not None and window.finite and taken == self.accumulation:
            state = state._smoothed(window)
        change = None if hold else state._decided()
        return state if change is None else state._changed(change)

    def _smoothed(self, window: Window) -> ScheduleState:
        gradient_sq, trace_sigma = window_estimates(window.small, window.big, window.small_batch, window.big_batch)
        if self.gradient_sq is None or self.trace_sigma is None:
            smoothed = (gradient_sq, trace_sigma)
        else:
            d = self.rule.decay
            smoothed = (d * self.gradient_sq + (1 - d) * gradient_sq, d * self.trace_sigma + (1 - d) * trace_sigma)
        state = replace(
            self, gradient_sq=smoothed[0], trace_sigma=smoothed[1], windows=self.windows + 1, settled=self.settled + 1
        )
        point = NoisePoint(self.step, self.samples, self.global_batch, state.b_simple)
        sizes = (window.small_batch, window.big_batch)
        kept = tuple(w for w in self.recent if w[2:] == sizes)[-(RECENT - 1) :]
        return replace(state, noise=(*self.noise, point), recent=(*kept, (window.small, window.big, *sizes)))

    def noise_scale(self, confidence: float = 0.9, seed: int = 0) -> NoiseScale | None:
        """The noise scale of the recent windows at the current batch sizes, with its bootstrap interval
        (`NoiseScale`, unsmoothed: what the last ``RECENT`` metered steps say); ``None`` before two windows.
        No pass was run for it: the windows are the training's own steps."""
        if len(self.recent) < 2:
            return None
        small_batch, big_batch = self.recent[-1][2:]
        return NoiseScale.from_windows(
            [(small, big) for small, big, _, _ in self.recent],
            small_batch,
            big_batch,
            passes=0,
            samples=len(self.recent) * big_batch,
            elapsed_s=0.0,
            confidence=confidence,
            seed=seed,
            notes=(f"measured during training from its last {len(self.recent)} metered steps, no pass of its own",),
        )

    def _decided(self) -> ScheduleChange | None:
        if self.rule.policy == "noise":
            return self._measured()
        if self.rule.policy in ("ramp", "seesaw"):
            return self._passed()
        return None

    def _measured(self) -> ScheduleChange | None:
        """One doubling when the doubled batch is at most ``fraction x`` the smoothed ``B_simple``, the guards
        allowing."""
        rule = self.rule
        doubled = self.accumulation * 2
        if doubled > rule.max_accumulation or self.step - self.last_change < rule.min_steps:
            return None
        target = rule.global_batch(doubled)
        if self.settled < rule.settle or self.gradient_sq is None or self.trace_sigma is None:
            return None
        b_simple = self.b_simple
        if b_simple is None and self.trace_sigma > 0:  # |G|^2 <= 0: the noise drowns the signal
            why = f"the signal |G|^2 did not show above the noise: B_simple beyond the batches measured, >= {target}"
            return self._change(doubled, rule.lr_rule, None, why)
        if b_simple is None or rule.fraction * b_simple < target:
            return None
        why = f"B_simple ~{b_simple:.0f} x {rule.fraction:g} >= the doubled batch {target}"
        recent = self.noise_scale()
        if recent is not None:
            why += f" (the last {recent.windows} windows alone: {recent.interval_text()})"
        return self._change(doubled, rule.lr_rule, b_simple, why)

    def _passed(self) -> ScheduleChange | None:
        """An open loop: at the step whose samples pass a threshold, one doubling per threshold passed
        since the last change (two at once where a step passes two), as far as ``max_accumulation``
        allows. The thresholds alone set the schedule: ``min_steps`` and ``settle`` are the closed
        loop's guards against a noisy estimate, which an open loop does not have."""
        rule = self.rule
        since = self.changes[-1].samples if self.changes else 0
        passed = [t for t in rule.thresholds if since < t <= self.samples]
        accumulation, applied = self.accumulation, []
        for threshold in passed:
            if accumulation * 2 > rule.max_accumulation:
                break
            accumulation, applied = accumulation * 2, [*applied, threshold]
        if not applied:
            return None
        shown = ", ".join(str(t) for t in applied)
        why = f"{rule.policy}: {self.samples} samples passed the threshold{'s' if len(applied) > 1 else ''} {shown}"
        return self._change(accumulation, rule.lr_rule, None, why)

    def _change(self, accumulation: int, lr_rule: str, noise_scale: float | None, why: str) -> ScheduleChange:
        ratio = accumulation / self.accumulation
        factor = ratio ** LR_EXPONENT[lr_rule]
        return ScheduleChange(
            step=self.step,
            samples=self.samples,
            accumulation=accumulation,
            global_batch=self.rule.global_batch(accumulation),
            lr_factor=self.lr_factor * factor,
            noise_scale=noise_scale,
            reason=why,
        )

    def _changed(self, change: ScheduleChange) -> ScheduleState:
        return replace(
            self,
            accumulation=change.accumulation,
            lr_factor=change.lr_factor,
            settled=0,
            last_change=self.step,
            changes=(*self.changes, change),
        )

    def check_resumable(self, world_size: int, micro_batch: int | None = None) -> None:
        """``ValueError`` naming what differs when a run resumes this state with another world size or
        micro-batch: the global batch (and so every sample count) would change silently."""
        if world_size != self.rule.world_size:
            raise ValueError(
                f"the saved batch schedule ran on {self.rule.world_size} ranks and this run has {world_size}: its "
                f"global batch ({self.global_batch}) and sample counts would change silently; resume on "
                f"{self.rule.world_size} ranks, or start a new schedule"
            )
        if micro_batch is not None and micro_batch != self.rule.micro_batch:
            raise ValueError(
                f"the saved batch schedule trained micro-batches of {self.rule.micro_batch} and this run asks for "
                f"{micro_batch}: resume with micro_batch={self.rule.micro_batch}, or start a new schedule"
            )

    def plot(self, path: str | os.PathLike[str], *, x: Literal["samples", "steps"] = "samples") -> Path:
        """Draw the realised batch against the measured noise scale to ``path`` (``.png``, ``.svg``,
        ``.pdf``); the path written. Needs matplotlib: ``pip install 'batchfit[plot]'``."""
        from batchfit.report.schedule_plot import plot_schedule  # lazy: the image reads this record (a cycle)

        return plot_schedule(self, path, x=x)

    def summary(self) -> str:
        """The rule, every change with its reason, the latest noise scale, the Megatron string."""
        from batchfit.report.schedule_text import schedule_text  # lazy: the text reads this record (a cycle)

        return schedule_text(self)

    def __str__(self) -> str:
        return self.summary()

    def steps(self) -> tuple[tuple[int, int, int], ...]:
        """``(step, samples, global_batch)`` from the start and at every change: the realised schedule."""
        start = (0, 0, self.rule.global_batch(self.rule.accumulation))
        return (start, *((c.step, c.samples, c.global_batch) for c in self.changes))

    def megatron(self, seq_length: int | None = None) -> str:
        """The realised schedule as Megatron-LM's ``--step-batch-size-schedule`` (``"0:768 250B:1536"``):
        thresholds in tokens with ``seq_length`` (as Megatron reads them when ``--seq-length`` is set),
        else in samples; batches in samples."""
        scale = seq_length or 1
        return " ".join(f"{_suffixed(samples * scale)}:{batch}" for _, samples, batch in self.steps())

    def olmo_core(self, seq_length: int | None = None) -> dict[str, list[int]]:
        """The realised schedule as OLMo-core's ``BatchSizeSchedulerCallback`` takes it: ``batch_sizes``
        and the ``schedule`` points they start at, in tokens with ``seq_length`` (OLMo-core counts
        both in tokens), else in samples."""
        scale = seq_length or 1
        steps = self.steps()
        return {
            "batch_sizes": [batch * scale for _, _, batch in steps],
            "schedule": [samples * scale for _, samples, _ in steps],
        }


def _suffixed(count: int) -> str:
    """``250000000000`` as ``250B``: Megatron's K/M/B/T suffixes, used only where exact."""
    for suffix, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= size and count % size == 0:
            return f"{count // size}{suffix}"
    return str(count)
