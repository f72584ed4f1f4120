"""The safe batch: the largest size that leaves the headroom free, then verified by real steps."""

from __future__ import annotations

import math
from collections.abc import Callable

from batchfit.probe.options import Options
from batchfit.report import MemoryModel, Trial, TrialKind, Unit
from batchfit.search import SearchReport
from batchfit.units import format_bytes


def safe_batch(
    report: SearchReport,
    trials: list[Trial],
    memory: MemoryModel | None,
    budget: int | None,
    options: Options,
    unit: Unit,
    run: Callable[[int, TrialKind, int | None], Trial],
) -> tuple[int, bool, list[str]]:
    """The largest size whose peak (in the budget's unit) leaves ``headroom`` of the budget
    free, then verified.

    Candidates: the largest fitting trial whose measured peak is within the target, and the
    memory equation's prediction (which can land between tried sizes). The verification must fit
    *and* leave the headroom (on CUDA reserved memory grows in segments, so a predicted size can
    overshoot); if it does not, step down by the headroom fraction and try again (at most three
    times). If none passes, the largest size that fitted any trial is returned, marked not
    verified, with a note in capitals: never a size that was not run.
    """
    notes: list[str] = []
    grid, headroom, verify_steps = options.grid(), options.headroom, options.verify_steps
    largest = report.largest_fit
    if budget is None:
        safe = largest
    else:
        target = budget * (1 - headroom)
        measured = [
            t.batch_size for t in trials if t.fits and t.peak_in(unit) is not None and t.peak_in(unit) <= target
        ]
        predicted = grid.floor(memory.largest_batch_within(target, ceiling=largest)) if memory else 0
        safe = min(largest, max([*measured, predicted, 0]))
        if safe < grid.init:
            safe = grid.init
            notes.append(f"even batch {grid.init} leaves less than {headroom:.0%} of the budget free")
    if verify_steps == 0:
        return safe, False, notes
    for _ in range(3):
        check = run(safe, "verify", verify_steps)
        peak = check.peak_in(unit)
        if check.fits and (budget is None or peak is None or peak <= budget * (1 - headroom) or safe == grid.init):
            return safe, True, notes
        notes.append(
            f"safe batch {safe} ran out of memory when verified with {verify_steps} steps"
            if not check.fits
            else f"safe batch {safe} used {format_bytes(peak)} when verified, more than the headroom allows"
        )
        lower = max(grid.init, grid.floor(math.floor(safe * (1 - max(headroom, 0.1)))))
        if lower == safe:
            break
        safe = lower
    # Never hand back a size that was not run: the largest one that fitted a trial.
    tried = [t.batch_size for t in trials if t.fits and t.batch_size <= safe]
    fallback = max(tried, default=grid.init)
    notes.append(
        f"NO SAFE BATCH WAS VERIFIED: batch {fallback} is the largest size that fitted a trial below the "
        f"candidates, but it was not verified with {verify_steps} steps; expect out-of-memory errors near it"
    )
    return fallback, False, notes
