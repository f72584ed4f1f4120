"""The sizes the throughput answer rests on, timed warm and alike, for about two steps at the max.

A search trial times one step, right after the previous trial's memory was released: page
faults, allocator growth and the first use of each shape land in it, and how much depends on
the size and on what ran before (the built-in GPT at 256 MiB on the CPU: batch 160's single
search step ran 119 samples/s, the safe batch 144's warm steps 395). So only warm steps are
ranked (those after an untimed step of the same trial, `is_warm`), every size measured the same
way: one untimed step, then ``timed_steps`` timed ones. What is timed, in order:

1. the knee's neighbourhood (`time_knee`), after the search: first a quarter of the largest
   batch, unless a warm rate up there is known (a GPU's search trials each run a warm step); then a
   quarter of the knee until a size below it is slower than `KNEE_FRACTION` of the best, and the
   geometric middle of the two until they are within `KNEE_BRACKET` of each other. While no
   timed size reaches 95% of the largest batch's own search step (cold, so it can only
   understate the top's rate), the rates still climb: the next size is the geometric middle of
   the largest timed size and the largest batch. Sizes below the knee cost little; the phase
   starts no trial that would end past `KNEE_STEPS` steps of the largest batch (`knee_deadline`,
   at least `MIN_TIMING_S`; a trial's cost is estimated from its size, `trial_cost`), so a curve
   that still climbs does not pull the timing up to the largest batch. With ``timed_steps=1``
   its first size at or below an eighth of the largest batch is timed over `SPREAD_STEPS` steps,
   so that the answer knows how far single steps scatter (its ``spread``) for a fraction of a
   step at the top;
2. the safe batch, the top of the curve, by its verification (``batchfit.probe.finder`` runs it
   with ``1 + timed_steps`` steps when ``verify_steps`` asks fewer: a fresh optimizer's first
   step, then warm ones; under a meter that slows every step, the CPU's, ``timed_steps`` more,
   timed without it), which costs no trial of its own; with ``verify_steps=0`` a trial of its
   own (`time_safe`). It comes last: the verification proves the safe batch in the state
   everything else left behind (on the CPU each new batch shape keeps 512 KiB of address space
   for its kernels; under a real allocator's wall, ``tests/test_real_oom.py``, timing after the
   verification left the safe batch unable to train again in the same process). The largest
   batch is not timed again: that would take ``1 + timed_steps`` steps at the largest size to
   say what the safe batch, at most ``headroom`` below it, says where the rates flatten out.
   When the safe batch's rate moves the knee up, past the sizes timed before it, the answer says
   between which sizes it lies (`unpinned_notes`).

Only warm steps are compared (``batchfit.report.throughput``); the knee is then a property of
the model and the device, not of the search's path.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from batchfit.probe.options import Options
from batchfit.report import Throughput, Trial
from batchfit.report.throughput import KNEE_FRACTION, is_warm, knee_of, warm_rates
from batchfit.search import Grid

#: The untimed steps of a timing trial before its timed ones: the first step at a new size pays what a
#: warm one does not (on the CPU, ``nn.TransformerEncoder``'s first plain step at a size ran 1.06-1.10x
#: the steps after it, even right after another plain step).
UNTIMED_STEPS = 1
#: The knee is bisected until the slower size below it is within this ratio of it: the true
#: knee lies between the two, and the rates of sizes that close differ by about the noise of a step.
KNEE_BRACKET = 1.5
#: Until a slower size below the knee is timed, the next size is the knee divided by this.
KNEE_STEP_DOWN = 4
#: The knee's neighbourhood may take as long as this many steps at the largest batch took (its
#: search trial's step), and at least `MIN_TIMING_S` seconds (on a small model a trial's own
#: overhead, not its steps, decides).
KNEE_STEPS = 2.0
MIN_TIMING_S = 1.0
#: Timed steps of the neighbourhood's first size at or below the largest batch over `SPREAD_BELOW`
#: while no size has this many: the spread needs two, and steps that small cost little.
SPREAD_STEPS = 2
SPREAD_BELOW = 8

#: ``run(batch_size, timed_steps) -> Trial``: one trial of an untimed step, then ``timed_steps`` timed ones.
RunTimed = Callable[[int, int], Trial]


def warm_steps(options: Options) -> int:
    """The timed steps each warm timing trial runs after its untimed one (``Options.timed_steps``; 0:
    nothing is timed warm): read here, where it acts, by the search and the checkpointing fit."""
    return options.timed_steps


def knee_deadline(now: float, step_at_max_s: float | None, started: float, time_budget: float | None) -> float:
    """When the knee's neighbourhood stops being timed: `KNEE_STEPS` steps at the largest batch
    from ``now``, at least `MIN_TIMING_S`, never past the probe's ``time_budget``."""
    deadline = now + max(MIN_TIMING_S, KNEE_STEPS * (step_at_max_s or 0.0))
    return deadline if time_budget is None else min(deadline, started + time_budget)


def trial_cost(size: int, steps: int, largest: int, step_at_max_s: float | None) -> float:
    """What a trial of ``steps`` steps at ``size`` is expected to take, scaled from a step at the
    largest batch: a step's time grows about linearly with the batch where steps cost real compute
    (a small batch's fixed costs are understated, but such a step costs little either way)."""
    return steps * (step_at_max_s or 0.0) * size / largest


def step_at_max(trials: list[Trial], largest: int) -> float | None:
    """The median step time of the slowest fitting trial at or below ``largest`` (the largest
    batch's search step, as a rule): what one step at the top of the curve costs."""
    times = [t.step_time_s for t in trials if t.fits and t.batch_size <= largest and t.step_time_s]
    return max(times, default=None)


def next_knee_size(rates: dict[int, float], grid: Grid, top: int, top_rate: float | None = None) -> int | None:
    """The next size to time to pin the knee down, ``None`` once it is pinned (or cannot be).

    Args:
        rates: the warm rates so far, at sizes up to ``top``.
        grid: the sizes a probe may run.
        top: the largest batch.
        top_rate: a lower bound on the rate at ``top`` (its search step's, cold), or ``None``.

    While no size of ``rates`` up there is timed (none at ``top / KNEE_STEP_DOWN`` or above) or
    none is within `KNEE_FRACTION` of ``top_rate``, the rates still climb: the next size is a
    quarter of ``top``, then the geometric middle of the largest timed size and ``top``. Then the
    knee is the smallest timed size within `KNEE_FRACTION` of the best; until a slower size below
    it has been timed, the next size is the knee over `KNEE_STEP_DOWN`; then the geometric middle
    between that slower size and the knee, until the two are within `KNEE_BRACKET` of each other
    or no grid size lies between them.
    """
    highest = max(rates, default=0)
    best = max([*rates.values(), top_rate or 0.0])
    climbing = not any(rate >= KNEE_FRACTION * best for rate in rates.values())
    quarter = grid.floor(top // KNEE_STEP_DOWN)
    if highest < quarter or climbing:
        if highest * KNEE_BRACKET >= top:
            return None  # the knee is within the bracket of the top: the safe batch's rate says the rest
        candidate = quarter if highest < quarter else grid.floor(math.isqrt(highest * top))
        return candidate if highest < candidate < top and candidate >= grid.init else None
    knee = knee_of(rates)
    below = [size for size in rates if size < knee]
    if not below:
        candidate = grid.floor(max(grid.init, knee // KNEE_STEP_DOWN))
    else:
        lower = max(below)
        if knee <= KNEE_BRACKET * lower:
            return None
        candidate = grid.floor(math.isqrt(lower * knee))
        if candidate <= lower:
            return None
    if candidate >= knee or candidate < grid.init or candidate in rates:
        return None
    return candidate


def top_rate_of(trials: list[Trial], largest: int) -> float | None:
    """The largest batch's rate as its search trial timed it (``None``: not timed): cold on a CPU,
    so a lower bound on its warm rate."""
    return max((t.samples_per_s or 0.0 for t in trials if t.fits and t.batch_size == largest), default=None)


def time_knee(
    trials: list[Trial],
    largest: int,
    grid: Grid,
    run: RunTimed,
    timed_steps: int,
    out_of_time: Callable[[int, int], bool],
) -> list[str]:
    """Time the knee's neighbourhood (see the module docs), each size by ``run``, until it is
    pinned or ``out_of_time(size, timed_steps)`` says the next trial would end past its time; the
    trials land in ``trials`` (``run`` appends them). Returns
    the notes a reader needs (a size that failed when timed, a knee left unpinned because time
    ran out). No size above ``largest`` is ranked: on a GPU a search trial can fit warm above it,
    with the optimizer state kept, and fail from scratch."""
    top_rate = top_rate_of(trials, largest)
    asked: set[int] = set()
    while True:
        rates = warm_rates(trials, largest)  # as Throughput.of
        size = next_knee_size(rates, grid, largest, top_rate)
        if size is None or size in asked:  # asked already: its trial timed no warm step (a skipped update)
            return []
        repeated = size > largest // SPREAD_BELOW or any(
            is_warm(t) and len(t.step_times_s) >= SPREAD_STEPS for t in trials
        )  # the spread's second step where steps cost little
        steps = timed_steps if repeated else max(timed_steps, SPREAD_STEPS)
        if out_of_time(size, steps):
            below = knee_of(rates) if rates else largest
            return [
                f"throughput: the knee is not pinned down below batch {below}: the time for timing "
                "sizes warm ran out (each size timed is one more trial)"
            ]
        asked.add(size)
        if not run(size, steps).fits:
            return [failed_note(size)]


def timed_warm(trials: list[Trial], size: int, timed_steps: int) -> bool:
    """Whether a trial of ``trials`` timed ``size`` warm with at least ``timed_steps`` steps."""
    return any(is_warm(t) and t.batch_size == size and len(t.step_times_s) >= timed_steps for t in trials)


def time_safe(trials: list[Trial], safe: int, run: RunTimed, timed_steps: int) -> list[str]:
    """Time the safe batch warm unless its verification did (``verify_steps=0``, or a failed one)."""
    if timed_warm(trials, safe, timed_steps) or run(safe, timed_steps).fits:
        return []
    return [failed_note(safe)]


def failed_note(size: int) -> str:
    return f"throughput: batch {size} ran out of memory when timed again after the search, although it fitted before"


def unpinned_notes(trials: list[Trial], largest: int, safe: int, grid: Grid) -> list[str]:
    """A note when the safe batch's rate, timed last, moved the knee above the sizes timed before
    it: the knee then lies between the slower size below it and itself."""
    rates = warm_rates(trials, largest)
    before = {s: r for s, r in rates.items() if s != safe}
    if not rates or not before or knee_of(rates) == knee_of(before):
        return []
    knee = knee_of(rates)
    below = [size for size in rates if size < knee]
    if not below or next_knee_size(rates, grid, largest) is None:
        return []
    return [
        f"throughput: the safe batch's rate, timed last, moved the knee up to batch {knee}: it lies between "
        f"batch {max(below)} and {knee}"
    ]


def throughput_notes(throughput: Throughput | None) -> list[str]:
    """Say how far the throughput answer can be trusted."""
    if throughput is None:
        return []
    notes: list[str] = []
    if not throughput.warm:
        notes.append(
            "throughput: no size was timed warm (timed_steps=0, or time ran out): the rates are the search's own "
            "single steps, each run right after the previous trial's memory was released; compare them loosely"
        )
    if throughput.knee_batch == throughput.best_batch:
        return notes
    notes += [
        f"throughput: batch {throughput.knee_batch} reaches {throughput.knee_samples_per_s:,.1f} samples/s, within "
        f"5% of the best measured ({throughput.best_samples_per_s:,.1f} at batch {throughput.best_batch}): "
        "bigger batches hardly pay in speed"
    ]
    if throughput.within_noise:
        notes.append(
            f"throughput: the difference between batch {throughput.best_batch} and {throughput.knee_batch} is within "
            f"the measurement's noise (repeated steps spread by {throughput.spread:.0%})"
        )
    if throughput.single_step_best and not throughput.warm:  # warm sizes are timed alike, with timed_steps each
        notes.append(
            f"throughput: the rate of batch {throughput.best_batch} comes from one timed step (a search trial), "
            "which on a GPU also pays for the first use of that shape"
        )
    return notes
