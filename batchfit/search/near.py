"""An exact search that starts from a prediction: the frontier's search at each further length.

Pure logic, never imports torch, like the rest of `batchfit.search`.

Once one length of a frontier is measured, the fitted surface (``fixed + b (a s + q s^2)``)
predicts where the boundary lies at the next length, and how many bytes one more sample costs
there. `search_near` spends its trials on that prediction instead of growing from the
smallest size again: it tries just below the predicted boundary (`HEDGE`), then steps
along the measured memory (the bytes left under the budget divided by the bytes per sample,
Newton's step on a line) until a fit and a failure are grid neighbours. When the prediction is
right, that is three trials (a fit just below, the boundary, one more that fails; two without
the hedge); when the trials contradict the memory model twice it falls back to galloping (steps
that double) and bisection, which need no model. It stays exact either way: it returns only
when the largest fit and the smallest failure are neighbours on the grid (or the grid's top
fitted), as [`batchfit.search.search`][batchfit.search.core.search] does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from batchfit.errors import NothingFitsError
from batchfit.search.core import Attempt, Grid, SearchReport, Verdict, midpoint

__all__ = ["GALLOP_FRACTION", "HEDGE", "MODEL_MISSES", "NAME", "search_near"]

#: The name recorded in results for a search that started from a prediction.
NAME = "near"

#: The first gallop step, as a fraction of the predicted size (at least one grid step): wide
#: enough that a prediction a few percent off is bracketed in one or two steps.
GALLOP_FRACTION = 0.02

#: The first trial aims this fraction below the predicted boundary: a fit there gives the Newton
#: step a measured point to start from (the next trial then lands on the boundary when memory is
#: locally linear), where a failure just above the boundary says little (an out-of-memory
#: reports only a lower bound of the need) and costs a gallop down.
HEDGE = 0.02

#: After this many trials that contradict the memory model (a size it said fits failed, or one
#: it said fails fitted), the search gallops and bisects without it; counted apart for the slope
#: it was given and the slope its own fits measure (which replaces the given one once it exists).
MODEL_MISSES = 2


def search_near(
    oracle: Callable[[int], Verdict],
    grid: Grid,
    guess: float,
    bytes_per_sample: float,
    budget_bytes: int | None,
    should_stop: Callable[[], bool] | None = None,
    hedge: float = HEDGE,
    anchor: tuple[int, Callable[[int], Verdict]] | None = None,
) -> SearchReport:
    """The largest size on ``grid`` that fits, found from ``guess`` (a predicted boundary).

    The first trial aims ``hedge`` (a fraction) below the guess; a caller that knows its
    predictions are exact (the last one was) passes 0 and pays two trials: the boundary, and
    one more that fails.

    ``anchor``: ``(size, trial)``, a trial to run first instead of the hedged one, at a size
    expected to fit with room to spare (the frontier runs the safe batch's verification there: it
    verifies the safe batch and gives the Newton step its measured point in one trial). A fit
    there is a fit; a failure (it ran under a lower cap) says nothing about the budget and is not
    counted, and the search goes on from the hedged guess.

    ``bytes_per_sample``: what one more sample costs near the boundary, on the scale of the
    oracle's ``peak_bytes`` and of ``budget_bytes`` (``<= 0`` or no budget: no model, gallop
    from the guess). Two fits at sizes far enough apart give a local slope that replaces it.
    ``should_stop`` is consulted once something fitted. Raises [`NothingFitsError`][batchfit.NothingFitsError] when
    ``grid.init`` fails.
    """
    step_size = grid.multiple_of
    attempts: list[Attempt] = []
    low: int | None = None  # the largest size that fitted
    high: int | None = None  # the smallest size that failed
    fits_at: dict[int, int] = {}
    misses = {"given": 0, "measured": 0}  # contradicted proposals, per source of the slope
    aimed_with = "given"
    gallop = max(step_size, grid.floor(max(1, math.floor(GALLOP_FRACTION * max(guess, 1.0)))))
    # A guess at or above the top tries the top itself: when it fits, that one trial is the answer.
    size = grid.top if guess >= grid.top else _on_grid(guess * (1 - hedge), grid)
    expected_fit: bool | None = None
    if anchor is not None:
        anchored, trial = anchor
        verdict = trial(anchored)
        if verdict.fits and verdict.peak_bytes is not None:
            low, fits_at[anchored] = anchored, verdict.peak_bytes
            if budget_bytes is not None and bytes_per_sample > 0:  # Newton from the anchor, as below
                size = grid.floor(math.floor(anchored + (budget_bytes - verdict.peak_bytes) / bytes_per_sample + 1e-9))
                size, expected_fit = (size, True) if size > anchored else (anchored + step_size, False)
            if low >= grid.top:
                return SearchReport(low, None, (), False, "max_batch", NAME)
            size = _inside(size, low, high, grid)

    while True:
        verdict = oracle(size)
        fits = bool(verdict.fits)
        phases = tuple((str(p), int(b)) for p, b in getattr(verdict, "phase_peaks", None) or ())
        attempts.append(Attempt(size, fits, verdict.peak_bytes, phases))
        if expected_fit is not None and expected_fit != fits:
            misses[aimed_with] += 1
        if fits:
            low = size if low is None else max(low, size)
            if verdict.peak_bytes is not None:
                fits_at[size] = verdict.peak_bytes
        else:
            high = size if high is None else min(high, size)
            if size <= grid.init:
                raise NothingFitsError(
                    grid.init,
                    needed_bytes=verdict.peak_bytes,
                    budget_bytes=budget_bytes,
                    phase=getattr(verdict, "phase", None),
                )
        if low is not None and high is not None and high - low <= step_size:
            return SearchReport(low, high, tuple(attempts), True, "boundary", NAME)
        if low is not None and high is None and low >= grid.top:
            return SearchReport(low, None, tuple(attempts), False, "max_batch", NAME)
        if low is not None and should_stop is not None and should_stop():
            return SearchReport(low, high, tuple(attempts), False, "stopped", NAME)
        local = _local_slope(fits_at)
        source = "measured" if local else "given"
        slope = local or bytes_per_sample
        boundary = None
        if (
            low is not None
            and low in fits_at
            and budget_bytes is not None
            and slope > 0
            and misses[source] < MODEL_MISSES
        ):
            boundary = grid.floor(math.floor(low + (budget_bytes - fits_at[low]) / slope + 1e-9))
            if high is not None and boundary >= high:
                boundary = None  # it aims at a size known to fail: the model is short here, bisect
        if boundary is not None:
            assert low is not None
            if boundary > low:
                size, expected_fit = boundary, True
            else:  # the model says low is the boundary: check that one more fails
                size, expected_fit = low + step_size, False
            aimed_with = source
        else:
            expected_fit = None
            if high is None:
                assert low is not None
                size = low + gallop
            elif low is None:
                # A failure's peak is a lower bound of its need: the excess over the budget, at the
                # modelled bytes per sample, is how far down the boundary lies at least.
                excess = (verdict.peak_bytes or 0) - (budget_bytes or 0)
                jump = math.ceil(excess / slope) if slope > 0 and budget_bytes is not None and excess > 0 else 0
                size = high - max(gallop, grid.floor(jump))
            else:
                size = midpoint(low, high, grid)
            gallop *= 2
        size = _inside(size, low, high, grid)


def _on_grid(guess: float, grid: Grid) -> int:
    """The guess as a size on the grid, within ``[init, top]``."""
    if not math.isfinite(guess):
        return grid.top if guess > 0 else grid.init
    return max(grid.init, min(grid.top, grid.floor(math.floor(guess))))


def _inside(size: int, low: int | None, high: int | None, grid: Grid) -> int:
    """``size`` on the grid, strictly between the largest fit and the smallest failure."""
    step = grid.multiple_of
    lower = grid.init if low is None else low + step
    upper = grid.top if high is None else high - step
    return max(lower, min(grid.floor(size), upper))


def _local_slope(fits_at: dict[int, int]) -> float | None:
    """Bytes per sample measured near the boundary: the secant from the largest fit to the
    smallest fit within half of it (the widest span that stays local), when the peaks grow."""
    if len(fits_at) < 2:
        return None
    top = max(fits_at)
    below = [b for b in fits_at if top / 2 <= b < top]
    if not below:
        return None
    bottom = min(below)
    rise = fits_at[top] - fits_at[bottom]
    return rise / (top - bottom) if rise > 0 else None
