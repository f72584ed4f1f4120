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


def safe_cap(budget: int, headroom: float, keep_free: int = 0) -> int:
    """The lowered cap the safe batch runs under: ``(1 - headroom) x budget``, and at most the budget less
    ``keep_free`` (room for one more of the step's largest allocation: `boundary_room`)."""
    return min(math.floor(budget * (1 - headroom)), budget - keep_free)


def boundary_room(trials: list[Trial], largest_fit: int, smallest_fail: int | None) -> tuple[int, str | None]:
    """What the safe batch's cap keeps free beyond the headroom's share, and why (``None``: nothing).

    On a caching allocator the step's largest single allocation at the boundary (one more of it: the
    longer sequence, the epoch-2 fragmentation a headroom is for), read from the trials at the largest
    fit and the smallest failure (a failure further up asks for a larger block than the boundary's
    step makes), plus under ``backend:cudaMallocAsync``
    the largest overhead the driver's pool showed beyond the bytes requested (it differs between
    processes, while the fraction caps requested bytes only: taken off the safe batch, not the max).
    """
    facts = [t.allocator for t in trials if t.allocator is not None]
    neighbours = (largest_fit, smallest_fail)
    at_boundary = [
        t.allocator.largest_request_bytes
        for t in trials
        if t.allocator is not None and t.allocator.largest_request_bytes and t.batch_size in neighbours
    ]
    block = max(at_boundary, default=0)
    pool = max((f.pool_overhead_bytes or 0 for f in facts), default=0)
    if not block and not pool:
        return 0, None
    parts = [f"one more of the step's largest allocation ({format_bytes(block)})"] if block else []
    if pool:
        parts.append(f"the cudaMallocAsync pool's overhead seen ({format_bytes(pool)})")
    return block + pool, " and ".join(parts)


def _verified_within(
    trials: list[Trial], size: int, steps: int, cap: int | None, init: int, within: float
) -> int | None:
    """The largest size in ``[(1 - within) x size, size]`` that ``trials`` hold a passed
    verification of, with ``steps`` steps under ``cap`` (as `safe_batch` runs it); ``None``."""
    sizes = [
        t.batch_size
        for t in trials
        if t.kind == "verify"
        and t.fits
        and t.steps >= steps
        and (1 - within) * size <= t.batch_size <= size
        and t.cap_bytes == (cap if t.batch_size > init else None)
    ]
    return max(sizes, default=None)


def safe_batch(
    report: SearchReport,
    trials: list[Trial],
    memory: MemoryModel | None,
    budget: int | None,
    options: Options,
    unit: Unit,
    run: RunTrial,
    keep_within: float = 0.0,
    steps: int | None = None,
    keep_free: tuple[int, str | None] = (0, None),
) -> tuple[int, bool, list[str]]:
    """The largest size that *runs* under a cap of ``(1 - headroom) x budget``, verified there.

    What a headroom means is checked as it is meant: the verification runs under the lowered
    cap, and passes when the steps fit. A peak read under the full budget would not say it: a
    caching allocator keeps freed blocks until it reaches its cap, so every size near the
    boundary shows a reserved peak of about the cap, whatever it needs.

    Candidates: the largest fitting trial whose measured peak is within the lowered cap (it never
    reached that cap, so it runs under it alike), and the memory equation's prediction (which
    can land between tried sizes; the equation is fitted on the trials that did not press against
    the cap, see `batchfit.probe.checks.fit_memory`). A candidate that fails under the
    lowered cap steps down by `STEP_DOWN` of its size, at most `ATTEMPTS` times. If
    none passes, the largest size that fitted any trial below the candidates is verified once
    more (a real allocator's wall, fragmentation or an address-space limit, can sit below the
    step-downs and above it) and returned, verified if it passed, else marked not verified with a
    note in capitals: never a size that was not run.

    A verification already among ``trials`` (a searcher may run it first, see
    ``batchfit.probe.finder.search_with``) is not run again; one within ``keep_within`` (a
    fraction) below the candidate is kept as the safe batch instead of verifying the candidate
    (the frontier's lengths: 0 for ``find()``). ``steps``: the verification's steps, when they
    are more than ``options.verify_steps`` (its last steps then time the safe batch warm, see
    ``batchfit.probe.timing``). ``keep_free``: bytes the cap keeps free whatever the headroom, and why
    (`boundary_room`); a note says so when they lower it.
    """
    notes: list[str] = []
    grid, headroom = options.grid(), options.headroom
    verify_steps = options.verify_steps if steps is None else steps
    largest = report.largest_fit
    cap: int | None = None
    if budget is None:
        safe = largest
    else:
        cap = safe_cap(budget, headroom, keep_free[0])
        if cap < safe_cap(budget, headroom):
            notes.append(
                f"the safe batch runs under {format_bytes(cap)}, below the {headroom:.0%} headroom's "
                f"{format_bytes(safe_cap(budget, headroom))}: the headroom keeps room for {keep_free[1]} "
                "(see docs/concepts/measuring.md#what-fits-on-cuda)"
            )
        measured = [t.batch_size for t in trials if t.fits and t.peak_in(unit) is not None and t.peak_in(unit) <= cap]
        predicted = grid.floor(memory.largest_batch_within(cap, ceiling=largest)) if memory else 0
        safe = min(largest, max([*measured, predicted, 0]))
        if safe < grid.init:
            safe = grid.init
            notes.append(f"even batch {grid.init} leaves less than {headroom:.0%} of the budget free")
    if verify_steps == 0:
        return safe, False, notes
    lowest_failed: int | None = None
    kept = _verified_within(trials, safe, verify_steps, cap, grid.init, keep_within)
    if kept is not None and kept < safe:
        notes.append(
            f"safe batch {kept} was verified first (the search's first trial, aimed by the memory surface); the "
            f"memory line's candidate {safe} is within {keep_within:.0%} of it, so it was kept without another trial"
        )
        return kept, True, notes
    for _ in range(ATTEMPTS):
        under = cap if safe > grid.init else None
        if _verified_within(trials, safe, verify_steps, cap, grid.init, 0.0) == safe:  # a searcher ran it
            return safe, True, notes
        check = run(safe, "verify", verify_steps, under)
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
    # Never hand back a size that was not run: the largest one that fitted a trial, verified once
    # more where it is below every failed candidate. A real allocator's wall (fragmentation, an
    # address-space limit) can sit below the step-downs and above that size: then it is verified.
    tried = [t.batch_size for t in trials if t.fits and (lowest_failed is None or t.batch_size < lowest_failed)]
    fallback = max(tried, default=grid.init)
    if lowest_failed is not None and fallback < lowest_failed:
        check = run(fallback, "verify", verify_steps, cap if fallback > grid.init else None)
        if check.fits:
            notes.append(
                f"safe batch {fallback} is the largest size below the failed candidates that fitted a trial, verified "
                f"with {verify_steps} steps: the memory line's candidates ran out of memory where it predicted room"
            )
            return fallback, True, notes
        notes.append(f"safe batch {fallback} ran out of memory when verified with {verify_steps} steps too")
    notes.append(
        f"NO SAFE BATCH WAS VERIFIED: batch {fallback} is the largest size that fitted a trial below the "
        f"candidates, but it was not verified with {verify_steps} steps; expect out-of-memory errors near it"
    )
    return fallback, False, notes
