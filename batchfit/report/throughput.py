"""What the timed steps say about speed: the best size, the knee, and the noise."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from batchfit.report.codec import Batch, NotAbove, Range, Rate
from batchfit.report.records import Trial

#: The knee is the smallest timed size whose samples/s reach this fraction of the best.
KNEE_FRACTION = 0.95


def best_timed(trials: Sequence[Trial]) -> dict[int, Trial]:
    """Each size's best-timed fitting trial: the one with the most timed steps (the first on a
    tie). A one-step search trial's rate is noisier than the verification's, so it must not
    outvote it."""
    timed: dict[int, Trial] = {}
    for trial in trials:
        if not trial.fits or not trial.samples_per_s:
            continue
        known = timed.get(trial.batch_size)
        if known is None or len(trial.step_times_s) > len(known.step_times_s):
            timed[trial.batch_size] = trial
    return timed


@dataclass(frozen=True)
class Throughput:
    """What the timed steps say about speed, and how far to trust it.

    Each size's rate is ``batch_size / median step time`` of its best-timed trial (the one with
    the most timed steps: the verification at the safe batch times two steps after the step that
    allocates the optimizer state; a one-step search trial times its only step, which on a GPU
    also pays for the first use of that shape).

    Attributes:
        best_batch, best_samples_per_s: the size with the highest rate.
        knee_batch, knee_samples_per_s: the smallest size within 5% of the best rate
            (:data:`KNEE_FRACTION`): past it, bigger batches stop paying in throughput. Never
            above ``best_batch``, which is within 5% of itself.
        spread: the relative spread of repeated step times, ``(slowest - fastest) / median``,
            the largest over the sizes timed more than once (``None``: no size was). Rates that
            differ by less than this are not told apart by the measurement.
        within_noise: the best rate exceeds the knee's by less than ``spread``: "best" is then
            one measurement's luck as much as a real difference.
        single_step_best: the best rate comes from a single timed step.
    """

    best_batch: Batch
    best_samples_per_s: Rate
    knee_batch: Annotated[Batch, NotAbove("best_batch")]
    knee_samples_per_s: Rate
    spread: Annotated[float, Range(0)] | None = None
    within_noise: bool = False
    single_step_best: bool = False

    @classmethod
    def of(cls, trials: Sequence[Trial]) -> Throughput | None:
        """The throughput answer of ``trials`` (``None`` when no fitting trial was timed)."""
        timed = best_timed(trials)
        if not timed:
            return None
        rates = {size: trial.samples_per_s or 0.0 for size, trial in timed.items()}
        best = max(rates, key=lambda size: rates[size])
        knee = min(size for size, rate in rates.items() if rate >= KNEE_FRACTION * rates[best])
        spreads = [
            (max(t.step_times_s) - min(t.step_times_s)) / t.step_time_s
            for t in timed.values()
            if len(t.step_times_s) >= 2 and t.step_time_s
        ]
        spread = max(spreads) if spreads else None
        return cls(
            best_batch=best,
            best_samples_per_s=rates[best],
            knee_batch=knee,
            knee_samples_per_s=rates[knee],
            spread=spread,
            within_noise=spread is not None and knee != best and rates[best] - rates[knee] < spread * rates[knee],
            single_step_best=len(timed[best].step_times_s) < 2,
        )
