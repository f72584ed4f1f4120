"""The safe batch: the largest size that runs under a cap of ``(1 - headroom) x budget``, verified."""

from __future__ import annotations

import math
from collections.abc import Callable

from batchfit.probe.options import Options
from batchfit.report import MemoryModel, Trial, TrialKind, Unit
from batchfit.search import SearchReport
from batchfit.units import format_bytes

#: Verification attempts before the fallback, and the step down after each failed one (a
#: fraction of the size; small, because the candidate was already aimed at the lowered cap).
ATTEMPTS = 4
STEP_DOWN = 0.03

#: ``run(batch_size, kind, steps, cap_bytes)``: one real trial, under ``cap_bytes`` when given.
RunTrial = Callable[[int, TrialKind, "int | None", "int | None"], Trial]


def safe_batch(
    report: SearchReport,
    trials: list[Trial],
    memory: MemoryModel | None,
    budget: int | None,
    options: Options,
    unit: Unit,
    run: RunTrial,
) -> tuple[int, bool, list[str]]:
    """The largest size that *runs* under a cap of ``(1 - headroom) x budget``, verified there.

    What a headroom means is checked as it is meant: the verification runs under the lowered
    cap, and passes when the steps fit. A peak read under the full budget would not say it: a
    caching allocator keeps freed blocks until it reaches its cap, so every size near the
    boundary shows a reserved peak of about the cap, whatever it needs.

    Candidates: the largest fitting trial whose measured peak is within the lowered cap (it never
    reached that cap, so it runs under it alike), and the memory equation's prediction (which
    can land between tried sizes; the equation is fitted on the trials that did not press against
    the cap, see :func:`batchfit.probe.checks.fit_memory`). A candidate that fails under the
    lowered cap steps down by :data:`STEP_DOWN` of its size, at most :data:`ATTEMPTS` times. If
    none passes, the largest size that fitted any trial below the candidates is returned, marked
    not verified, with a note in capitals: never a size that was not run.
    """
    notes: list[str] = []
    grid, headroom, verify_steps = options.grid(), options.headroom, options.verify_steps
    largest = report.largest_fit
    cap: int | None = None
    if budget is None:
        safe = largest
    else:
        cap = math.floor(budget * (1 - headroom))
        measured = [t.batch_size for t in trials if t.fits and t.peak_in(unit) is not None and t.peak_in(unit) <= cap]
        predicted = grid.floor(memory.largest_batch_within(cap, ceiling=largest)) if memory else 0
        safe = min(largest, max([*measured, predicted, 0]))
        if safe < grid.init:
            safe = grid.init
            notes.append(f"even batch {grid.init} leaves less than {headroom:.0%} of the budget free")
    if verify_steps == 0:
        return safe, False, notes
    lowest_failed: int | None = None
    for _ in range(ATTEMPTS):
        check = run(safe, "verify", verify_steps, cap if safe > grid.init else None)
        if check.fits:
            return safe, True, notes
        lowest_failed = safe
        notes.append(
            f"safe batch {safe} ran out of memory when verified with {verify_steps} steps"
            + (f" under {format_bytes(cap)}, the budget less its {headroom:.0%} headroom" if cap is not None else "")
        )
        lower = max(grid.init, grid.floor(math.floor(safe * (1 - STEP_DOWN))))
        if lower == safe:
            break
        safe = lower
    # Never hand back a size that was not run: the largest one that fitted a trial.
    tried = [t.batch_size for t in trials if t.fits and (lowest_failed is None or t.batch_size < lowest_failed)]
    fallback = max(tried, default=grid.init)
    notes.append(
        f"NO SAFE BATCH WAS VERIFIED: batch {fallback} is the largest size that fitted a trial below the "
        f"candidates, but it was not verified with {verify_steps} steps; expect out-of-memory errors near it"
    )
    return fallback, False, notes
