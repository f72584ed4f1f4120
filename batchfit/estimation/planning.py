"""From a probe's answer to a training set-up: a target global batch as micro-batch x accumulation steps.

A user rarely wants "the largest batch that fits": they want a *global* batch (what the learning rate
and the schedule were tuned for) and need to know how to reach it on their devices. :func:`plan_for`
splits that target over the ranks and into gradient-accumulation steps, choosing the per-rank
micro-batch from what the probe measured: only sizes within the verified safe batch, and among those
the fastest measured one, because the memory boundary says what *can* run, not what runs best.

Pure Python (no torch import): a plan can be made from a result loaded from JSON on a machine
without torch. :func:`batchfit.plan` (``batchfit.api``) also takes a model, and probes it first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchfit.report import KNEE_FRACTION, Result, Trial

__all__ = ["ALTERNATIVE_FACTOR", "Plan", "check_target", "plan_for"]

#: A non-exact split is worth mentioning when its micro-batch is at least this many times the exact
#: one's: below that, the exact split costs little, above it the user may prefer to drop a few samples.
ALTERNATIVE_FACTOR = 4


@dataclass(frozen=True)
class Plan:
    """How to train with a target global batch: ``world_size`` ranks x ``micro_batch`` x ``accumulation_steps``.

    Attributes:
        target_batch: the global batch asked for.
        world_size: the ranks the global batch is spread over.
        micro_batch: the batch each rank runs per forward/backward (per rank, per step).
        accumulation_steps: forward/backward passes whose gradients are summed before one
            optimizer step.
        global_batch: ``micro_batch * accumulation_steps * world_size``, what the plan really trains
            with (``target_batch`` when ``exact``).
        exact: ``global_batch == target_batch``.
        remainder: ``target_batch - global_batch``, 0 when exact. Stated, never dropped silently: a
            plan that trains on fewer samples than asked says so.
        samples_per_s: the rate measured at ``micro_batch`` (the whole group's when the probe ran
            on several ranks), ``None`` when that size was not timed.
        knee_batch: the probe's throughput knee (past it, bigger batches hardly pay in speed),
            shown beside so that a reader sees how the micro-batch compares; ``None`` when the
            probe timed nothing.
        safe_batch: the probe's safe batch, the bound of ``micro_batch``.
        reason: why this micro-batch, in one sentence.
    """

    target_batch: int
    world_size: int
    micro_batch: int
    accumulation_steps: int
    global_batch: int
    exact: bool
    remainder: int
    samples_per_s: float | None
    knee_batch: int | None
    safe_batch: int
    reason: str

    def __post_init__(self) -> None:
        # A plan whose numbers disagree would mislead exactly where it matters (how many samples an
        # optimizer step sees), so an inconsistent one cannot be built.
        if self.global_batch != self.micro_batch * self.accumulation_steps * self.world_size:
            raise ValueError(
                f"global_batch {self.global_batch} is not micro_batch {self.micro_batch} x accumulation_steps "
                f"{self.accumulation_steps} x world_size {self.world_size}"
            )
        if self.remainder != self.target_batch - self.global_batch or self.exact != (self.remainder == 0):
            raise ValueError(
                f"exact={self.exact} and remainder={self.remainder} do not match target_batch {self.target_batch} "
                f"and global_batch {self.global_batch}"
            )

    def __str__(self) -> str:
        ranks = f"{self.world_size} ranks x " if self.world_size > 1 else ""
        steps = "step" if self.accumulation_steps == 1 else "steps"
        exactness = "exact" if self.exact else f"{self.remainder} short of the target {self.target_batch}"
        text = (
            f"global batch {self.global_batch} = {ranks}micro-batch {self.micro_batch} x "
            f"{self.accumulation_steps} accumulation {steps} ({exactness})"
        )
        if self.samples_per_s is not None:
            text += f"; {self.samples_per_s:,.0f} samples/s measured at micro-batch {self.micro_batch}"
        text += f"; safe batch {self.safe_batch}"
        if self.knee_batch is not None:
            text += f", throughput knee {self.knee_batch}"
        return text + f". {self.reason}"


def plan_for(result: Result, target_batch: int, world_size: int | None = None) -> Plan:
    """Split ``target_batch`` (global) into ``world_size`` ranks x micro-batch x accumulation steps.

    The per-rank share ``target_batch // world_size`` is split exactly: the micro-batch is a divisor
    of it, at most ``result.safe_batch`` (the safe batch, not the max batch: it keeps the headroom
    and was verified with extra steps), and a multiple of ``settings.multiple_of`` where one
    divides (otherwise the multiple is ignored, and the reason says so). Among those divisors:

    * the fastest *measured* one (each size's best-timed fitting trial, as
      :meth:`~batchfit.report.Throughput.of` counts it) wins over slower measured ones;
    * a larger divisor that was not timed wins over the fastest measured one, unless that one is
      already on the measured plateau (within :data:`~batchfit.report.KNEE_FRACTION` of the best
      rate measured at any size): below the plateau, the measurements say bigger is faster, and the
      larger divisor also needs fewer accumulation steps;
    * with nothing timed, the largest divisor (fewest accumulation steps).

    An exact split always exists (1 divides everything), so the plan returned is always exact. When
    it is poor (e.g. a prime per-rank share larger than the safe batch leaves micro-batch 1), the
    reason also names the non-exact alternative and how many samples it would leave out, for the
    user to choose; it is never applied silently.

    Args:
        result: a probe's answer (:func:`batchfit.find`); its batch sizes are per rank.
        target_batch: the global batch to reach, summed over every rank and accumulation step.
        world_size: the ranks to train on; default ``result.world_size``.

    Raises:
        TypeError: ``result`` is not a :class:`~batchfit.report.Result`, or ``target_batch`` /
            ``world_size`` is not an int.
        ValueError: ``target_batch`` or ``world_size`` is not positive, or ``target_batch`` is not
            divisible by ``world_size``.
    """
    if not isinstance(result, Result):
        raise TypeError(f"result must be a batchfit Result, got {type(result).__name__}")
    check_target(target_batch, world_size)
    if world_size is None:
        world_size = result.world_size
        check_target(target_batch, world_size)
    safe = result.safe_batch
    if safe < 1:
        raise ValueError(f"the result's safe_batch is {safe}: not even one sample fits, there is nothing to plan")
    per_rank = target_batch // world_size
    multiple_of = max(1, result.settings.multiple_of)

    notes: list[str] = []
    divisors = _divisors_within(per_rank, safe)  # never empty: 1 <= safe
    candidates = [d for d in divisors if d % multiple_of == 0]
    if not candidates:
        candidates = divisors
        notes.append(f"no divisor of {per_rank} within the safe batch is a multiple of {multiple_of}, so it is ignored")

    rates = _measured_rates(result.trials)
    micro, why = _choose(per_rank, safe, candidates, rates)

    alternative = _alternative(per_rank, safe, multiple_of)
    if alternative >= ALTERNATIVE_FACTOR * micro and per_rank % alternative:
        alt_steps = per_rank // alternative
        alt_global = alternative * alt_steps * world_size
        notes.append(
            f"no exact split has a larger micro-batch: micro-batch {alternative} x {alt_steps} accumulation "
            f"step{'s' * (alt_steps != 1)} would give a global batch of {alt_global}, remainder "
            f"{target_batch - alt_global} (samples left out, so not chosen)"
        )
    if world_size != result.world_size and micro in rates:
        notes.append(f"the rates were measured with {result.world_size} rank(s), not {world_size}")

    steps = per_rank // micro
    global_batch = micro * steps * world_size
    return Plan(
        target_batch=target_batch,
        world_size=world_size,
        micro_batch=micro,
        accumulation_steps=steps,
        global_batch=global_batch,
        exact=global_batch == target_batch,
        remainder=target_batch - global_batch,
        samples_per_s=rates.get(micro),
        knee_batch=result.throughput.knee_batch if result.throughput is not None else None,
        safe_batch=safe,
        reason="; ".join([why, *notes]) + ".",
    )


def check_target(target_batch: Any, world_size: Any = None) -> None:
    """The checks of :func:`plan_for` that need no result, so that ``batchfit.plan(model, ...)``
    refuses a bad target before it spends a probe on it."""
    _check_positive_int("target_batch", target_batch)
    if world_size is None:
        return
    _check_positive_int("world_size", world_size)
    if target_batch % world_size:
        raise ValueError(
            f"target_batch {target_batch} is not divisible by world_size {world_size}: every rank must get a whole "
            f"share (the nearest are {target_batch // world_size * world_size} and "
            f"{(target_batch // world_size + 1) * world_size})"
        )


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}")


def _divisors_within(n: int, limit: int) -> list[int]:
    """The divisors of ``n`` that are at most ``limit``, increasing. The work is
    ``min(limit, sqrt(n))`` steps: only micro-batches within the safe batch are candidates, so a
    huge target (``2**61 - 1``) costs no more than the safe batch, not the square root of it."""
    root = math.isqrt(n)
    if limit <= root:
        return [d for d in range(1, limit + 1) if n % d == 0]
    small = [d for d in range(1, root + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if n // d != d and n // d <= limit]


def _measured_rates(trials: tuple[Trial, ...]) -> dict[int, float]:
    """samples/s per size, from each size's best-timed fitting trial, as
    :meth:`~batchfit.report.Throughput.of` counts them (:func:`~batchfit.report.best_timed`)."""
    from batchfit.report import best_timed

    return {size: trial.samples_per_s or 0.0 for size, trial in best_timed(trials).items()}


def _choose(per_rank: int, safe: int, candidates: list[int], rates: dict[int, float]) -> tuple[int, str]:
    """The micro-batch among ``candidates`` (increasing divisors of ``per_rank``), and why."""
    largest = candidates[-1]
    share = f"the per-rank share {per_rank}"
    biggest = (
        f"micro-batch {largest} is the largest divisor of {share} within the safe batch {safe} "
        "(fewest accumulation steps)"
    )
    timed = [d for d in candidates if d in rates]
    if not timed:
        return largest, biggest + "; none of its divisors was timed"
    fastest = max(timed, key=lambda d: (rates[d], d))
    rate = rates[fastest]
    best_size = max(rates, key=lambda size: (rates[size], size))
    on_plateau = rate >= KNEE_FRACTION * rates[best_size]
    untimed_larger = [d for d in candidates if d > fastest and d not in rates]
    if untimed_larger and not on_plateau:
        pick = untimed_larger[-1]  # a timed divisor above it ran slower than ``fastest``: not it
        head = (
            biggest
            if pick == largest
            else (
                f"micro-batch {pick} is the largest divisor of {share} within the safe batch {safe} "
                f"not measured slower (the larger {largest} ran at {rates[largest]:,.0f} samples/s)"
            )
        )
        return pick, (
            f"{head}; it was not timed, but the fastest timed divisor ({fastest}, {rate:,.0f} samples/s) is below "
            f"the measured plateau ({KNEE_FRACTION:.0%} of {rates[best_size]:,.0f} samples/s at batch {best_size}), "
            "where bigger batches still paid"
        )
    why = f"micro-batch {fastest} is the fastest measured divisor of {share} ({rate:,.0f} samples/s)"
    slower = [d for d in timed if d > fastest]
    if slower:
        why += f"; the larger {slower[-1]} measured slower ({rates[slower[-1]]:,.0f} samples/s)"
    if untimed_larger:
        why += (
            f"; larger divisors up to {untimed_larger[-1]} were not timed, and {fastest} is already on the measured "
            f"plateau (within {1 - KNEE_FRACTION:.0%} of the best rate, {rates[best_size]:,.0f} samples/s "
            f"at batch {best_size})"
        )
    return fastest, why


def _alternative(per_rank: int, safe: int, multiple_of: int) -> int:
    """The micro-batch of the best non-exact split: as large as the safe batch and the share allow,
    rounded down to ``multiple_of`` where that leaves something."""
    micro = min(safe, per_rank)
    rounded = micro // multiple_of * multiple_of
    return rounded if rounded >= 1 else micro
