"""The batch schedule's rule, pure: how the batch may change during a run, and the learning rate with it.

Pure Python (no torch). The state a run carries, and the decisions this rule makes after each step,
are `batchfit.report.schedule`'s; the trainer (`BatchSchedule`) applies them.

**The rule** (``policy="noise"``, the closed loop). The global batch is ``micro_batch x
accumulation x world_size``; only the accumulation changes (the micro-batch stays the one batchfit
verified). After each metered step, the smoothed simple noise scale ``B_simple`` (an exponential
moving average of ``|G|^2`` and of ``tr(Sigma)`` taken *separately*, then divided, as McCandlish et
al. 2018's appendix A does) is compared with the batch: when the doubled global batch is at most
``fraction x B_simple`` (default a half), the accumulation doubles. Why this rule:

* McCandlish's trade-off: a batch ``B`` takes ``S_min (1 + B_noise / B)`` steps and
  ``E_min (1 + B / B_noise)`` samples, so at ``B = B_noise / 2`` a run spends at most 1.5x the
  fewest samples while its steps fall with the batch; keeping the batch at or below half the
  measured noise scale (the power of two at or below ``B_simple / 2``) buys steps for few samples.
  A larger fraction grows sooner and spends more samples: in the prototype of
  ``benchmarks/schedule.py``, ``fraction=1`` ended at a validation loss of 2.05 where the constant
  batch reached 1.98 on the same samples; a smoothed ``|G|^2`` not above zero (the signal drowned in
  the noise) means a noise scale beyond the batches measured, and the batch doubles too;
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
``lr_rule``; ``"seesaw"`` (arXiv 2510.14717) doubles at the ``thresholds`` where the run's own
decaying schedule (cosine, step decay) halves the learning rate, and multiplies the rate by the
``lr_rule`` on top of that schedule, which keeps running: with ``"sqrt"`` the net is Seesaw's rule,
the rate x ``1/sqrt(2)`` and the batch x 2 where the schedule alone would halve the rate
(`seesaw_thresholds` gives the points of a cosine).
An open loop changes at the step whose samples pass a threshold (twice at once where a step passes
two), under ``max_accumulation`` only: ``min_steps`` and ``settle`` guard the measured loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, get_args

from batchfit.report.codec import Batch, Count, JsonRecord, Range
from batchfit.units import check_positive_int

Policy = Literal["noise", "constant", "ramp", "seesaw"]
#: What the noise scale is read from: the micro-batches and their sum (accumulation, or DDP's
#: all-reduce), or each example's gradient of the LayerNorms alone (Gray et al. 2024).
MeterSource = Literal["micro-batches", "layernorm"]
LrRule = Literal["sqrt", "linear", "none"]
POLICIES: tuple[str, ...] = get_args(Policy)
METERS: tuple[str, ...] = get_args(MeterSource)
LR_RULES: tuple[str, ...] = get_args(LrRule)

#: The exponent of the batch ratio each rule multiplies the learning rate by.
LR_EXPONENT = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}
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
        lr_rule: how the learning rate follows the batch.
        every: meter every this many optimizer steps (``"noise"``).
        min_steps: at least this many steps from the start and between two changes (``"noise"``).
        settle: metered windows at the current batch before ``"noise"`` may change it.
        decay: the moving average's weight on the past, per metered window.
        fraction: the share of the smoothed ``B_simple`` the doubled batch may reach (``"noise"``).
        meter: ``"micro-batches"`` or ``"layernorm"`` (per-example LayerNorm gradients; ``"noise"``).
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
    fraction: Annotated[float, Range(0)] = 0.5
    meter: MeterSource = "micro-batches"
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
        if self.meter not in METERS:
            raise ValueError(f"meter must be one of {', '.join(METERS)}, got {self.meter!r}")
        if self.policy == "noise" and self.meter == "layernorm" and self.micro_batch < 2:
            raise ValueError(
                "the LayerNorm meter compares an example's gradient with its micro-batch's, and a micro-batch of 1 "
                "has one size only: train micro-batches of 2 or more, or meter='micro-batches'"
            )
        if self.policy == "noise" and self.meter == "micro-batches" and self.accumulation < 2 and self.world_size < 2:
            raise ValueError(
                "a noise-driven schedule compares the gradients of two batch sizes, and with accumulation 1 on one "
                "process there is only one: start at accumulation >= 2, train data-parallel (DDP, world_size >= 2), "
                "or meter='layernorm' (each example's LayerNorm gradients against the micro-batch's)"
            )
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)):
            raise TypeError(f"decay must be a number in [0, 1), got {type(self.decay).__name__} {self.decay!r}")
        if not 0 <= self.decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {self.decay!r}")
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)):
            shown = f"{type(self.fraction).__name__} {self.fraction!r}"
            raise TypeError(f"fraction must be a number in (0, 1], got {shown}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
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
