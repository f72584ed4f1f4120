"""The boundary as a fresh process meets it: confirmed from scratch on both sides, moved where it is not.

Why: a search keeps the optimizer between trials (its state does not depend on the batch size), so
later trials run with the memory layout the first, small trial left. Under a caching allocator that
layout carries: a fresh process at batch ``b`` carves the state (and, on CUDA, the cuBLAS workspaces)
out of ``b``'s own segments, and can fragment more, or less, than the probe did. Three runs on an
H200 showed both: the probe's largest fit failing in a fresh process, and ``max + 1`` training there.

So where layout matters, the boundary is confirmed by trials from scratch (each a replay of a fresh
process) on both sides: the largest fit must fit from scratch and the next size up must not. When the
largest fit fails from scratch, the boundary is bisected down with trials from scratch; when the next
size fits from scratch, it gallops up and bisects with them. Outcomes from scratch need not be
monotone (one run: 68 fitted warm and failed from scratch, 63 failed, 61 fitted, 62 failed), so the
answer is a neighbouring pair seen from scratch, a fit and a failure, never a fit inferred from a
bisection's assumption. Pure: it takes an oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from batchfit.search.core import Attempt, Grid, SearchReport, Verdict, midpoint


class _FromScratch:
    """The oracle from scratch, each size asked once, every call kept as an attempt."""

    def __init__(self, oracle: Callable[[int], Verdict]) -> None:
        self.oracle = oracle
        self.verdicts: dict[int, bool] = {}
        self.attempts: list[Attempt] = []

    def fits(self, size: int) -> bool:
        if size not in self.verdicts:
            # The oracle is called here, not through a helper: the path from `find` to the model stays short.
            verdict = self.oracle(size)
            self.attempts.append(Attempt(size, verdict.fits, verdict.peak_bytes))
            self.verdicts[size] = verdict.fits
        return self.verdicts[size]

    def bisect(self, low: int, high: int, grid: Grid) -> tuple[int, int]:
        """Between a size that fits (``low``) and one that fails (``high``), the neighbouring pair."""
        while high - low > grid.multiple_of:
            size = midpoint(low, high, grid)
            if self.fits(size):
                low = size
            else:
                high = size
        return low, high


def confirm_from_scratch(
    report: SearchReport, grid: Grid, from_scratch: Callable[[int], Verdict], known_fit: int
) -> SearchReport:
    """``report`` with its boundary as trials from scratch find it, on both sides.

    ``from_scratch(b)`` runs a trial at ``b`` as a new process would (no state kept from an earlier
    trial); ``known_fit`` is a size below the largest fit that a trial with no optimizer state fitted (the
    search's first), the floor of a bisection down. Trials: the largest fit, and the size above it when
    the search saw that fail; more only where one of them disagrees with the search.
    """
    top, step = report.largest_fit, grid.multiple_of
    scratch = _FromScratch(from_scratch)
    if scratch.fits(top):
        low = top
        high: int | None = None
        above = top + step
        if report.smallest_fail is not None and above <= grid.top:
            if scratch.fits(above):  # gallop up from scratch until a size fails, then bisect
                low, jump = above, step
                while high is None and low < grid.top:
                    jump *= 2
                    size = min(grid.top, low + jump)
                    if scratch.fits(size):
                        low = size
                    else:
                        high = size
                if high is not None:
                    low, high = scratch.bisect(low, high, grid)
            else:
                high = above
    else:
        # Gallop down from scratch (the answer is usually a size or two below), then bisect.
        high, jump, floor = top, step, min(known_fit, top - step)
        low = max(floor, top - jump)
        while low > floor and not scratch.fits(low):
            high, jump = low, jump * 2
            low = max(floor, grid.floor(top - jump))
        low, high = scratch.bisect(low, high, grid)
        # The bisection assumed its floor fits; where the floor is the answer, it must fit from scratch too.
        while low not in scratch.verdicts and not scratch.fits(low):
            below = grid.floor(low // 2)
            if below < grid.init:  # nothing down to the first size fits from scratch: the search's word stands
                break
            low, high = scratch.bisect(below, low, grid)
    attempts = report.attempts + tuple(scratch.attempts)
    if scratch.verdicts.get(low) is False:  # nothing fitted from scratch: the search's answer, with its attempts
        return replace(report, attempts=attempts)
    if high is None:  # the largest fit held and nothing above it was seen to fail from scratch
        if low == top:
            return replace(report, attempts=attempts)
        top_reached = {"boundary_reached": False, "stop_reason": "max_batch"}
        return replace(report, largest_fit=low, smallest_fail=None, attempts=attempts, **top_reached)
    reached = high - low <= step
    return replace(
        report,
        largest_fit=low,
        smallest_fail=high,
        attempts=attempts,
        boundary_reached=reached,
        stop_reason="boundary" if reached else report.stop_reason,
    )
