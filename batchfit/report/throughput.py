"""What the timed steps say about speed: the best size, the knee, and the noise.

Only like is compared with like: when any size was timed warm (steps after an untimed step of
the same trial, `is_warm`), the rates come from warm steps alone; a cold step (a search
trial's only step, right after the previous trial's memory was released) is never ranked
against them. ``batchfit.probe.timing`` times the sizes the answer depends on warm.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from batchfit.report.codec import Batch, NotAbove, Range, Rate, Seconds
from batchfit.report.records import Trial

#: The knee is the smallest timed size whose samples/s reach this fraction of the best.
KNEE_FRACTION = 0.95


def is_warm(trial: Trial) -> bool:
    """Whether ``trial``'s timed steps ran warm: it fitted and ran an untimed step first (steps
    2..N are timed; a one-step trial times its only, cold step)."""
    return trial.fits and trial.steps >= 2 and bool(trial.step_times_s)


def warm_steps_by_size(trials: Sequence[Trial]) -> dict[int, list[float]]:
    """Every warm step time of ``trials``, per batch size (all the trials at a size pooled)."""
    times: dict[int, list[float]] = {}
    for trial in trials:
        if is_warm(trial):
            times.setdefault(trial.batch_size, []).extend(trial.step_times_s)
    return times


def warm_rates(trials: Sequence[Trial], largest: int | None = None) -> dict[int, float]:
    """Samples/s per batch size from warm steps only: ``batch_size / median step time``. Across
    ranks a trial's times are the slowest rank's and its rate counts every rank's samples, so
    the rate is scaled as the trials' own ``samples_per_s`` is. ``largest``: no size above it
    (see `Throughput.of`)."""
    if largest is not None:
        trials = [t for t in trials if t.batch_size <= largest]
    scale = {
        t.batch_size: (t.samples_per_s or 0.0) * (t.step_time_s or 0.0) / t.batch_size for t in trials if is_warm(t)
    }
    return {
        size: scale.get(size, 1.0) * size / statistics.median(times)
        for size, times in warm_steps_by_size(trials).items()
        if statistics.median(times) > 0
    }


def knee_of(rates: dict[int, float]) -> int:
    """The smallest size whose rate is within `KNEE_FRACTION` of the best (``rates`` not empty)."""
    best = max(rates.values())
    return min(size for size, rate in rates.items() if rate >= KNEE_FRACTION * best)


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

    When any size was timed warm (after the search, ``batchfit.probe.timing``), only warm steps
    are ranked: each size's rate is ``batch_size / median`` of its pooled warm steps. Otherwise
    (no warm timing asked, a frontier length) each size's rate comes from its best-timed trial (the
    one with the most timed steps); a one-step search trial times its only step, which pays for
    page faults, allocator growth and, on a GPU, the first use of that shape.

    Attributes:
        best_batch, best_samples_per_s: the size with the highest rate.
        knee_batch, knee_samples_per_s: the smallest size within 5% of the best rate
            (`KNEE_FRACTION`): past it, bigger batches stop paying in throughput. Never
            above ``best_batch``, which is within 5% of itself.
        spread: the relative spread of repeated step times, ``(slowest - fastest) / median``,
            the largest over the sizes timed more than once (``None``: no size was). Rates that
            differ by less than this are not told apart by the measurement.
        within_noise: the best rate exceeds the knee's by less than ``spread``: "best" is then
            one measurement's luck as much as a real difference.
        single_step_best: the best rate comes from a single timed step.
        warm: the rates come from warm steps only (see the module docs); ``False``: from the
            search's own steps, some of them cold (no size was timed warm).
        rates: ``(batch_size, samples/s)`` of every size compared, ascending.
        timing_s: the time spent timing sizes warm after the search (``None``: none was).
    """

    best_batch: Batch
    best_samples_per_s: Rate
    knee_batch: Annotated[Batch, NotAbove("best_batch")]
    knee_samples_per_s: Rate
    spread: Annotated[float, Range(0)] | None = None
    within_noise: bool = False
    single_step_best: bool = False
    warm: bool = False
    rates: tuple[tuple[Batch, Rate], ...] = ()
    timing_s: Seconds | None = None

    @classmethod
    def of(
        cls, trials: Sequence[Trial], timing_s: float | None = None, largest: int | None = None
    ) -> Throughput | None:
        """The throughput answer of ``trials`` (``None`` when no fitting trial was timed): from
        their warm steps when any size has some (``warm``), else from every timed trial.
        ``timing_s``: the time spent timing sizes warm after the search (``batchfit.probe.timing``).
        ``largest``: the largest batch found; sizes above it are not ranked. On a GPU a size can fit
        with the optimizer state kept from a smaller trial and fail from scratch (the allocator's
        layout carries): the best batch must be one a fresh run trains at."""
        if largest is not None:
            trials = [t for t in trials if t.batch_size <= largest]
        warm = warm_rates(trials)
        if warm:
            steps = warm_steps_by_size(trials)
            rates, counts = warm, {size: len(times) for size, times in steps.items()}
            spreads = [
                (max(times) - min(times)) / statistics.median(times)
                for times in steps.values()
                if len(times) >= 2 and statistics.median(times) > 0
            ]
        else:
            timed = best_timed(trials)
            if not timed:
                return None
            rates = {size: trial.samples_per_s or 0.0 for size, trial in timed.items()}
            counts = {size: len(trial.step_times_s) for size, trial in timed.items()}
            spreads = [
                (max(t.step_times_s) - min(t.step_times_s)) / t.step_time_s
                for t in timed.values()
                if len(t.step_times_s) >= 2 and t.step_time_s
            ]
        best = max(rates, key=lambda size: rates[size])
        knee = knee_of(rates)
        spread = max(spreads) if spreads else None
        return cls(
            best_batch=best,
            best_samples_per_s=rates[best],
            knee_batch=knee,
            knee_samples_per_s=rates[knee],
            spread=spread,
            within_noise=spread is not None and knee != best and rates[best] - rates[knee] < spread * rates[knee],
            single_step_best=counts[best] < 2,
            warm=bool(warm),
            rates=tuple(sorted(rates.items())),
            timing_s=timing_s,
        )

    def rate_of(self, batch_size: int) -> float | None:
        """The samples/s measured at ``batch_size`` (``None``: not among the sizes compared)."""
        return dict(self.rates).get(batch_size)
