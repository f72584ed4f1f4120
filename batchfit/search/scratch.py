"""The boundary as a fresh process meets it: the largest fit confirmed from scratch, searched down if it fails.

Why: a search keeps the optimizer between trials (its state does not depend on the batch size),
so later trials run with the state where the first, small trial put it. Under a caching
allocator that layout carries: a fresh process at batch ``b`` carves the state out of ``b``'s
own activation segments in its first step, and can fragment more than the probe did (in the
allocator model, GPT-2-small bf16 under 24 GiB fitted batch 22 in one process and only 19 from
scratch). So where layout matters the largest fit is tried once more from scratch, and when that
fails the boundary is bisected with trials from scratch. Pure: it takes an oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from batchfit.search.core import Attempt, Grid, SearchReport, Verdict, midpoint


def confirm_from_scratch(
    report: SearchReport, grid: Grid, from_scratch: Callable[[int], Verdict], known_fit: int
) -> SearchReport:
    """``report`` with its largest fit as trials from scratch find it.

    ``from_scratch(b)`` runs a trial at ``b`` as a new process would (no state kept from an
    earlier trial); ``known_fit`` is a size known to fit so (the search's first trial ran from
    scratch), below ``report.largest_fit``. One trial when the largest fit holds; else a
    bisection between ``known_fit`` and it, the failed size becoming the smallest failure.
    """
    top = report.largest_fit
    if known_fit >= top:
        return report
    attempts: list[Attempt] = []
    low, high, size = known_fit, top, top
    while True:
        # The oracle is called here, not through a helper: the path from `find` to the model stays short.
        verdict = from_scratch(size)
        attempts.append(Attempt(size, verdict.fits, verdict.peak_bytes))
        if verdict.fits and size == top:
            return replace(report, attempts=report.attempts + tuple(attempts))
        if verdict.fits:
            low = size
        else:
            high = size
        if high - low <= grid.multiple_of:
            break
        size = midpoint(low, high, grid)
    smallest_fail = high if report.smallest_fail is None else min(report.smallest_fail, high)
    return replace(
        report,
        largest_fit=low,
        smallest_fail=smallest_fail,
        attempts=report.attempts + tuple(attempts),
        boundary_reached=smallest_fail - low <= grid.multiple_of,
        stop_reason="boundary" if smallest_fail - low <= grid.multiple_of else report.stop_reason,
    )
