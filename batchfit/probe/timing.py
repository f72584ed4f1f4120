"""The sizes the throughput answer rests on, timed warm and alike.

A search trial times one step, right after the previous trial's memory was released: page
faults, allocator growth and the first use of each shape land in it, and how much depends on
the size and on what ran before (the built-in GPT at 256 MiB on the CPU: batch 160's single
search step ran 119 samples/s, the safe batch 144's warm steps 395). Ranking sizes by such
rates names as "best" whichever size happened to be timed warm: the safe batch, which its
verification times over several steps. So after the search the sizes the answer depends on
are timed again, each in the same way: one untimed step, then ``timed_steps`` timed ones
(`time_warm`):

1. the largest batch and the safe batch (the answer names both), unless a size already has
   ``timed_steps`` warm steps in one trial: the safe batch's verification (one step that
   allocates the optimizer state, then timed ones) is such a trial with the default
   ``verify_steps=3``, and timing it again would only double the cost of its large steps (the
   safe batch is timed after its verification; everything else before it, so that the
   verification proves the safe batch in the state timing leaves behind);
2. the knee's neighbourhood: halving below the smallest size within 5% of the best rate until a
   size below it is slower than that, then bisecting (geometrically) between the two until they
   are within `KNEE_BRACKET` of each other, while the phase's time lasts
   (`timing_deadline`, counted from when step 1 is done: on a CPU the two largest sizes'
   steps alone can outlast any share of a short search, and must not leave the knee untimed).

Only warm steps (those after an untimed step of the same trial, `is_warm`) are compared
with each other (``batchfit.report.throughput``); the knee is then a property of the model and
the device, not of the search's path.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from batchfit.report import Trial
from batchfit.report.throughput import KNEE_FRACTION, is_warm, warm_rates
from batchfit.search import Grid

#: The knee is bisected until the slower size below it is within this ratio of it.
KNEE_BRACKET = 1.25
#: The knee's neighbourhood may take this share of the probe's time so far, and at least
#: `MIN_TIMING_S` seconds (the largest and the safe batch are timed in any case).
TIMING_SHARE = 0.5
MIN_TIMING_S = 5.0

#: ``run(batch_size) -> Trial``: one trial of an untimed step and the timed ones, kind ``"time"``.
RunTimed = Callable[[int], Trial]


def timing_deadline(now: float, started: float, time_budget: float | None) -> float:
    """When the knee's neighbourhood stops being timed: `TIMING_SHARE` of the time the
    probe took so far, at least `MIN_TIMING_S`, and never past the probe's ``time_budget``."""
    deadline = now + max(MIN_TIMING_S, TIMING_SHARE * (now - started))
    return deadline if time_budget is None else min(deadline, started + time_budget)


def knee_of(rates: dict[int, float]) -> int:
    """The smallest size whose rate is within `KNEE_FRACTION` of the best (``rates`` not empty)."""
    best = max(rates.values())
    return min(size for size, rate in rates.items() if rate >= KNEE_FRACTION * best)


def next_knee_size(rates: dict[int, float], grid: Grid) -> int | None:
    """The next size to time to pin the knee down, ``None`` once it is pinned (or cannot be).

    The knee is the smallest timed size within `KNEE_FRACTION` of the best rate. Until a
    slower size below it has been timed, the next size is half the knee (on the grid); then the
    geometric middle between that slower size and the knee, until the two are within
    `KNEE_BRACKET` of each other or no grid size lies between them.
    """
    if not rates:
        return None
    knee = knee_of(rates)
    below = [size for size in rates if size < knee]
    if not below:
        candidate = grid.floor(max(grid.init, knee // 2))
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


def time_warm(
    trials: list[Trial],
    sizes: list[int],
    grid: Grid,
    run: RunTimed,
    timed_steps: int,
    start_neighbourhood: Callable[[], Callable[[], bool]] | None = None,
) -> list[str]:
    """Time ``sizes`` (a size with a trial of ``timed_steps`` warm steps already is not timed
    again), then, with ``start_neighbourhood``, the knee's neighbourhood, each by ``run``; the
    trials land in ``trials`` (``run`` appends them). ``start_neighbourhood()`` is called once
    ``sizes`` are timed and returns the ``out_of_time()`` that bounds the neighbourhood. Returns
    the notes a reader needs (a size that failed when timed, a knee left unpinned because time
    ran out). The neighbourhood ranks no size above the largest of ``sizes`` (the largest batch):
    on a GPU a search trial can fit warm above it and fail from scratch.

    ``batchfit.probe.finder`` calls it twice: the largest batch and the neighbourhood before the
    safe batch's verification, then the safe batch after it (its verification's steps usually
    count): the verification is the last trial of new sizes, so the safe batch is proven in the
    state the timing leaves behind.
    """
    notes: list[str] = []
    failed: list[int] = []
    for size in dict.fromkeys(sizes):  # in order, once each
        if any(is_warm(t) and t.batch_size == size and len(t.step_times_s) >= timed_steps for t in trials):
            continue  # already timed warm, as a "time" trial would
        if not run(size).fits:
            failed.append(size)
    out_of_time = start_neighbourhood() if start_neighbourhood is not None else None
    asked: set[int] = set()
    ceiling = max(sizes, default=None)  # the largest batch: a size above it fitted warm, not from scratch
    while out_of_time is not None:
        rates = {s: r for s, r in warm_rates(trials).items() if ceiling is None or s <= ceiling}  # as Throughput.of
        size = next_knee_size(rates, grid)
        if size is None or size in asked:  # asked already: its trial timed no warm step (a skipped update)
            break
        if out_of_time():
            notes.append(
                f"throughput: the knee is not pinned down below batch {knee_of(rates)}: the time for timing "
                "sizes warm ran out (each size timed is one more trial)"
            )
            break
        asked.add(size)
        if not run(size).fits:
            failed.append(size)
            break
    if failed:
        notes.append(
            "throughput: batch "
            + ", ".join(map(str, failed))
            + " ran out of memory when timed again after the search, although it fitted before"
        )
    return notes
