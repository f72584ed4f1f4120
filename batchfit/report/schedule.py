"""The batch schedule during training: the rule, its state, every change and why, pure.

Pure Python (no torch): the meter (``batchfit.probe.noise_meter``) hands over each metered step's
squared norms, the trainer (`batchfit.training_schedule`) applies what is decided here, and the
arithmetic can be tested exhaustively.

**The rule** (``policy="noise"``, the closed loop). The global batch is ``micro_batch x
accumulation x world_size``; only the accumulation changes (the micro-batch stays the one batchfit
verified). After each metered step, the smoothed simple noise scale ``B_simple`` (an exponential
moving average of ``|G|^2`` and of ``tr(Sigma)`` taken *separately*, then divided, as McCandlish et
al. 2018's appendix A does) is compared with the batch: when ``B_simple >= 2 x`` the global batch,
the accumulation doubles. Why this rule:

* below ``B_simple`` a step's samples still buy nearly proportional progress (McCandlish's
  ``steps = S_min (1 + B_noise / B)``), so a batch up to it costs few extra samples; doubling only
  once the *next* batch is still at most ``B_simple`` keeps the batch at or below the measured
  noise scale, the next power of two below it;
* one doubling per change, at most every ``min_steps`` steps, and only after ``settle`` metered
  windows at the current batch: the estimate is re-measured at the new size before it can act
  again, so one noisy window never jumps the batch far;
* the batch never shrinks (the noise scale grows as the loss falls; a shrink would re-spend the
  samples a larger batch saved) and never passes ``max_accumulation`` (the verified micro-batch
  times the most accumulation steps the run allows).

**The learning rate** moves with the batch by ``lr_rule``: ``"sqrt"`` (x sqrt(r) when the batch grows
r-fold: Adam-like optimizers, Malladi et al. 2022), ``"linear"`` (x r: SGD, Goyal et al. 2017),
``"none"``. **Open-loop baselines** share the same state: ``"constant"`` never changes;
``"ramp"`` (a batch warm-up, Merrill et al. 2025) doubles at fixed sample ``thresholds`` with the
``lr_rule``; ``"seesaw"`` (arXiv 2510.14717) doubles at the ``thresholds`` where a step-decay
schedule would halve the learning rate, multiplying the rate by ``1/sqrt(2)`` instead of halving it.
An open loop changes at the step whose samples pass a threshold (twice at once where a step passes
two), under ``max_accumulation`` only: ``min_steps`` and ``settle`` guard the measured loop.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, ClassVar, Literal, get_args

from batchfit.report.codec import Batch, Count, JsonRecord, Range
from batchfit.report.noise import window_estimates
from batchfit.units import check_positive_int

Policy = Literal["noise", "constant", "ramp", "seesaw"]
LrRule = Literal["sqrt", "linear", "none"]
POLICIES: tuple[str, ...] = get_args(Policy)
LR_RULES: tuple[str, ...] = get_args(LrRule)

#: The exponent of the batch ratio each rule multiplies the learning rate by.
_LR_EXPONENT = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}
#: Seesaw's learning-rate factor at each doubling, where step decay would have halved it.
SEESAW_LR_FACTOR = 1 / math.sqrt(2)
#: Optimizers by class name whose learning rate follows the batch by the square root (adaptive,
#: Adam-like: Malladi et al. 2022's SDE argument), and by the batch itself (SGD-like).
SQRT_OPTIMIZERS = frozenset(
    {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Adafactor", "Adagrad", "RMSprop", "Lion"}
)
LINEAR_OPTIMIZERS = frozenset({"SGD", "ASGD"})


def lr_rule_for(optimizer_name: str, lr_rule: str | None) -> LrRule:
    """The learning-rate rule to use: ``lr_rule`` if given, else the one ``optimizer_name``'s family
    takes; ``ValueError`` naming the optimizer when it is of neither family and no rule was given."""
    if lr_rule is not None:
        if lr_rule not in LR_RULES:
            raise ValueError(f"lr_rule must be one of {', '.join(LR_RULES)}, got {lr_rule!r}")
        return lr_rule  # type: ignore[return-value]
    if optimizer_name in SQRT_OPTIMIZERS:
        return "sqrt"
    if optimizer_name in LINEAR_OPTIMIZERS:
        return "linear"
    raise ValueError(
        f"batchfit does not know how the learning rate of {optimizer_name} should follow the batch: pass "
        "lr_rule='sqrt' (Adam-like), 'linear' (SGD-like) or 'none' (the rate left as it is)"
    )


@dataclass(frozen=True)
class ScheduleRule(JsonRecord):
    """How the batch may change during a run (see the module docs).

    Attributes:
        micro_batch: rows per forward/backward pass on each rank (the verified safe batch).
        accumulation: micro-batches per optimizer step at the start.
        max_accumulation: the most micro-batches per step the schedule may reach.
        world_size: data-parallel ranks; each runs ``accumulation`` micro-batches per step.
        policy: ``"noise"`` (closed loop) or an open-loop baseline.
        lr_rule: how the learning rate follows the batch (``"seesaw"`` has its own).
        every: meter every this many optimizer steps (``"noise"``).
        min_steps: at least this many steps from the start and between two changes (``"noise"``).
        settle: metered windows at the current batch before ``"noise"`` may change it.
        decay: the moving average's weight on the past, per metered window.
        thresholds: samples at which ``"ramp"``/``"seesaw"`` double the batch, increasing.
    """

    NOUN: ClassVar[str] = "batch schedule rule"

    micro_batch: Batch
    accumulation: Batch
    max_accumulation: Batch
    world_size: Batch = 1
    policy: Policy = "noise"
    lr_rule: LrRule = "sqrt"
    every: Batch = 10
    min_steps: Batch = 50
    settle: Batch = 3
    decay: Annotated[float, Range(0, 1)] = 0.9
    thresholds: tuple[Count, ...] = ()

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accumulation", "max_accumulation", "world_size", "every", "min_steps", "settle"):
            check_positive_int(name, getattr(self, name))
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.lr_rule not in LR_RULES:
            raise ValueError(f"lr_rule must be one of {', '.join(LR_RULES)}, got {self.lr_rule!r}")
        if self.max_accumulation < self.accumulation:
            raise ValueError(
                f"max_accumulation ({self.max_accumulation}) is below the starting accumulation ({self.accumulation})"
            )
        if self.policy == "noise" and self.accumulation < 2 and self.world_size < 2:
            raise ValueError(
                "a noise-driven schedule compares the gradients of two batch sizes, and with accumulation 1 on one "
                "process there is only one: start at accumulation >= 2, or train data-parallel (DDP, world_size >= 2)"
            )
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)):
            raise TypeError(f"decay must be a number in [0, 1), got {type(self.decay).__name__} {self.decay!r}")
        if not 0 <= self.decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {self.decay!r}")
        if self.policy in ("ramp", "seesaw") and not self.thresholds:
            raise ValueError(f"policy {self.policy!r} doubles the batch at sample thresholds: pass thresholds=")
        if isinstance(self.thresholds, (str, bytes)) or not isinstance(self.thresholds, (tuple, list)):
            raise TypeError(f"thresholds must be a sequence of sample counts, got {type(self.thresholds).__name__}")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.thresholds):
            raise TypeError(f"thresholds must be whole sample counts, got {list(self.thresholds)}")
        object.__setattr__(self, "thresholds", tuple(self.thresholds))  # a list would break hashing and ==
        if list(self.thresholds) != sorted(set(self.thresholds)) or any(t <= 0 for t in self.thresholds):
            raise ValueError(f"thresholds must be increasing sample counts above 0, got {list(self.thresholds)}")

    @property
    def rows_per_accumulation(self) -> int:
        """Samples one unit of accumulation adds to the global batch: ``micro_batch x world_size``."""
        return self.micro_batch * self.world_size

    def global_batch(self, accumulation: int) -> int:
        """The global batch at ``accumulation`` micro-batches per step."""
        return self.rows_per_accumulation * accumulation


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
        return replace(state, noise=(*self.noise, point))

    def _decided(self) -> ScheduleChange | None:
        if self.rule.policy == "noise":
            return self._measured()
        if self.rule.policy in ("ramp", "seesaw"):
            return self._passed()
        return None

    def _measured(self) -> ScheduleChange | None:
        """One doubling when the smoothed ``B_simple`` reaches the doubled batch, the guards allowing."""
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
        if b_simple is None or b_simple < target:
            return None
        why = f"B_simple ~{b_simple:.0f} >= the doubled batch {target}"
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
        seesaw = self.rule.policy == "seesaw"  # 1/sqrt(2) a doubling, where step decay would halve the rate
        factor = SEESAW_LR_FACTOR ** math.log2(ratio) if seesaw else ratio ** _LR_EXPONENT[lr_rule]
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


def ramp_thresholds(budget: int, fractions: Sequence[float]) -> tuple[int, ...]:
    """Sample thresholds at ``fractions`` of a ``budget`` (for ``"ramp"``), rounded to whole samples."""
    check_positive_int("budget", budget)
    if any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1 for f in fractions):
        raise ValueError(f"fractions must be numbers in (0, 1] of the budget, got {list(fractions)}")
    return tuple(sorted({max(1, round(budget * f)) for f in fractions}))


def seesaw_thresholds(budget: int, halvings: int) -> tuple[int, ...]:
    """Where a cosine schedule over ``budget`` samples reaches 1/2, 1/4, ... of its peak: the points
    at which Seesaw doubles the batch instead (``halvings`` of them; fewer where a small budget
    rounds two to one sample)."""
    check_positive_int("budget", budget)
    check_positive_int("halvings", halvings)
    points = (round(budget * math.acos(2 * 0.5**k - 1) / math.pi) for k in range(1, halvings + 1))
    return tuple(sorted({max(1, t) for t in points}))


def _suffixed(count: int) -> str:
    """``250000000000`` as ``250B``: Megatron's K/M/B/T suffixes, used only where exact."""
    for suffix, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= size and count % size == 0:
            return f"{count // size}{suffix}"
    return str(count)
