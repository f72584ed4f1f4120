"""The interpolating search strategy, ``"interpolate"``: pure logic, never imports torch.

[`Interpolating`][batchfit.search.interpolate.Interpolating] uses the memory the trials measured: it fits
``peak = fixed + per_sample * b`` per phase of the step and proposes the size where the fitted
line meets the budget, then closes the bracket right next to it. It falls back to the plain
proposal whenever its own guess could push the search past [`max_trials`][batchfit.search.core.max_trials],
so it keeps the plain strategy's worst-case bound, and for the rest of a search once the trials
have contradicted its model (the measured memory does not explain where sizes fail, as with a
real allocator that fails on memory the meter does not count), so that it then costs only a few
trials more than the plain strategy (see its docstring).

It builds on `batchfit.search` (the bracket, the grid, the plain strategy and the bound)
and imports nothing else of batchfit; `batchfit.search.strategies` maps its name to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction

from batchfit.search.core import Attempt, Bracket, Doubling, Grid, affordable, clamp, midpoint

__all__ = ["COLLINEAR", "DISTRUST", "HEDGE", "MISSES", "Interpolating"]

#: How far below the predicted boundary an unverified prediction aims once the model has
#: missed (a fraction of the distance from the largest fitting size). Lines fitted through the
#: smallest sizes can under-estimate the slope (the peak of a tiny batch sits on a different
#: phase or on a kink), so the prediction overshoots; a failure above the boundary teaches the
#: model nothing, while a fit just below it gives a point that pins the line down. Before any
#: miss the strategy aims at the prediction itself: on the memory of real models the line is
#: usually right, and the hedge then costs a trial near the boundary.
HEDGE = Fraction(1, 10)

#: A third point within this fraction of the line through the two largest ones makes the
#: line "verified" (memory is affine there) and the strategy aims at the boundary itself.
COLLINEAR = Fraction(1, 500)

#: The model is distrusted once trials contradicted it (a size it expected to fit failed, or
#: one it expected to fail fitted) in this many of its states, a state being the fitting sizes
#: it was fitted on and the target it aimed at: it learned from a miss (a new point, a lower
#: target) and missed again. From then on the strategy proposes what the plain one does.
DISTRUST = 2

#: ... or once it missed this many times in all, learning or not (one state can miss several
#: times: the gallop down from an over-estimate tries a few sizes before one fits).
MISSES = 5

#: The second trial goes to this fraction of the proportional jump (at least twice the first
#: size). A trial costs sample-steps, not a count: a fit at ``b`` runs its step on ``b`` samples.
#: The second point only has to give the line its slope, and at 1/8 of the jump it costs about
#: 1/8 of a trial near the boundary. Over the property shapes of ``tests/test_search.py``
#: (a fit costing ``b``, a failure ``0.6 b``) the whole search cost 1.62-1.72 boundary-steps on
#: affine memory and on the per-phase lines measured on the examples, against 1.64-2.49 when
#: the second trial was the whole jump.
SECOND_POINT = Fraction(1, 8)

#: While the two largest fitting sizes have the same total peak (a flat start: the optimizer
#: step's peak hides the batch), no line says how far the flat part goes, and the proportional
#: jump from it is no sure fit: the next guess is at most this multiple of the largest fit.
FLAT_GROWTH = 8


class Interpolating:
    """Memory-model strategy: aim at the size where the fitted memory line meets the budget.

    For every series of measured peaks (each phase of the step, and the total), the line
    through the two largest fitting sizes *where that series still grows* predicts the peak
    of a bigger batch; the predicted boundary ``p`` is the largest size whose predicted peak
    stays within the budget for every growing series (flat series, e.g. the optimizer step of
    a small batch, predict nothing). The budget is ``bracket.budget_bytes`` (or the one given
    to the constructor), lowered to the smallest failure bound seen (a failure's
    live-plus-requested bytes, which on CUDA can be below the nominal budget). Without a
    budget the strategy proposes exactly what the plain one does.

    Proposals, in order:

    * one fitting size and a budget: an eighth (`SECOND_POINT`, at least ``2 * low``) of
      the proportional jump ``low * budget / peak(low)``, which fits whenever the peak per
      sample does not grow with the batch (fixed bytes are >= 0): a sure fit gives the second
      point a line needs, where doubling may fail and give none, and a small one costs little.
      If the jump is not above ``low``, double;
    * a prediction above ``low``: ``p`` itself while no trial has contradicted the model, or
      when a third point confirms the line (a fit at the boundary and a failure one above is
      the cheapest end a search can have); after a miss, short of it by 10% (`HEDGE`)
      of how uncertain it is (the distance it extrapolates, or how far the last new point moved
      it, whichever is smaller);
    * a prediction at or below ``low`` (the model says ``low`` is the boundary): ``low + step``
      to confirm, then galloping up (10%, 20%, ... of the bracket) while such predictions keep
      being wrong;
    * a prediction at or above a failed ``high`` (the model over-estimates): galloping down
      from ``high`` by a fifth of the bracket, then more while sizes keep failing; gallops
      never pass the bracket's midpoint;
    * while the two largest fits measured the same total peak (a flat start), at most
      `FLAT_GROWTH` times ``low``;
    * no usable prediction: the plain proposal (double ``low``, or the midpoint; see
      `_plain`).

    **Distrust.** Each trial is checked against what the model expected before it ran: a size
    at or below the predicted boundary (or the proportional jump) should fit, a size above it
    should fail. Once the trials contradicted the model in two of its states (`DISTRUST`:
    it learned from a miss, a new fitting size or a lower target, and missed again) or five
    times in all (`MISSES`), the measured memory evidently does not say where sizes fail
    (a real allocator that fails on fragmentation or on memory the meter does not count, peaks
    unrelated to the limit), and every further proposal is the plain one. Memory that merely
    bends (a flat start, a kink) misses once or twice while the gallops close in and then
    predicts well, so it keeps the model. Under RLIMIT_AS on the CPU (the setup of
    ``tests/test_real_oom.py`` with a 4 GiB budget the capped process could never reach) this
    took 18 search trials where following the model took 36 and the plain strategy 27; with
    peaks unrelated to the boundary the property tests hold it to the plain strategy's count
    plus 8 (up to five misses, then the plain doubling restarted from ``low``).

    Trials are weighed by what they cost, sample-steps: a fit at ``b`` runs its step on ``b``
    samples, a failure dies part-way through one. With exact memory lines this finds the boundary in
    four trials whose only fit near the boundary is the boundary itself. Its worst case stays within
    [`max_trials`][batchfit.search.core.max_trials]: a guess is only taken if, whichever way it
    comes out, the plain strategy could still finish within the bound from there
    ([`affordable`][batchfit.search.core.affordable]); otherwise the plain proposal is used.
    """

    name = "interpolate"

    def __init__(self, budget_bytes: int | None = None) -> None:
        #: Used when the search hands no budget (``bracket.budget_bytes`` wins when it does).
        self.budget_bytes = budget_bytes

    def propose(self, bracket: Bracket) -> int:
        if bracket.budget_bytes is None and self.budget_bytes is not None:
            bracket = replace(bracket, budget_bytes=self.budget_bytes)
        plain = _plain(bracket)
        if _distrusted(bracket.attempts, bracket.budget_bytes, bracket.grid):
            return plain
        guess = _interpolated_guess(bracket)
        if guess is None:
            return plain
        if _flat_top(bracket.attempts):
            guess = min(guess, FLAT_GROWTH * bracket.low)
        guess = clamp(guess, bracket.low, bracket.high, bracket.grid)
        if not affordable(bracket, guess):
            return plain
        return guess


def _plain(bracket: Bracket) -> int:
    """The plain proposal from where this strategy left the bracket: double ``low`` while that
    stays below the smallest failure, then bisect.

    A search that only ever took the plain proposals never has a failure above twice its
    largest fit, so for it this is [`Doubling`][batchfit.search.core.Doubling]'s proposal. Here a guess
    may have failed far above the boundary (a model that over-estimates it), and bisecting
    down from there would cost about ``log2(high / boundary)`` trials more than the plain
    search takes from the start; doubling from ``low`` costs about what the plain search does
    (its ladder starts elsewhere, which can cost a trial or two).
    """
    low, high = bracket.low, bracket.high
    if high is not None and 2 * low < high and affordable(bracket, 2 * low):
        return 2 * low
    return Doubling().propose(bracket)


def _distrusted(attempts: Sequence[Attempt], budget: int | None, grid: Grid) -> bool:
    """Whether the trials contradicted the memory model too often to follow it any further.

    Each trial is compared with what the model built from the trials before it expected: a
    fit at or below its predicted boundary (before it has a line: at or below the proportional
    jump, which claims a sure fit), a failure above it. Sizes it had no opinion on count for
    nothing. See `DISTRUST` and `MISSES`.
    """
    states: list[tuple[int, int | None]] = []
    for index in range(1, len(attempts)):
        before = attempts[:index]
        expected = _expected_fit(before, budget, grid, attempts[index].batch_size)
        if expected is not None and expected != attempts[index].fits:
            states.append((sum(1 for attempt in before if attempt.fits), _target_bytes(before, budget)))
    return len(set(states)) >= DISTRUST or len(states) >= MISSES


def _flat_top(attempts: Sequence[Attempt]) -> bool:
    """Whether the two largest fitting sizes measured the same total peak (see FLAT_GROWTH)."""
    fits = sorted((a.batch_size, a.peak_bytes) for a in attempts if a.fits and a.peak_bytes is not None)
    return len(fits) >= 2 and fits[-1][1] <= fits[-2][1]


def _missed(attempts: Sequence[Attempt], budget: int | None, grid: Grid) -> bool:
    """Whether any trial contradicted what the model expected before it ran."""
    for index in range(1, len(attempts)):
        expected = _expected_fit(attempts[:index], budget, grid, attempts[index].batch_size)
        if expected is not None and expected != attempts[index].fits:
            return True
    return False


def _expected_fit(before: Sequence[Attempt], budget: int | None, grid: Grid, size: int) -> bool | None:
    """Whether the model built from ``before`` expected ``size`` to fit; ``None``: no opinion."""
    model = _predict(before, budget, grid)
    if model is not None:
        return size <= model[0]
    fitted = [attempt.batch_size for attempt in before if attempt.fits]
    jump = _proportional_jump(before, max(fitted), budget, grid) if fitted else None
    if jump is not None and size <= jump:
        return True
    return None


def _interpolated_guess(bracket: Bracket) -> int | None:
    """The interpolating strategy's wish, before clamping and the trial-bound check."""
    low, high, grid = bracket.low, bracket.high, bracket.grid
    step = grid.multiple_of
    attempts = bracket.attempts
    model = _predict(attempts, bracket.budget_bytes, grid)
    if model is None:
        jump = _proportional_jump(attempts, low, bracket.budget_bytes, grid)
        if jump is None:
            return None
        single = sum(1 for attempt in attempts if attempt.fits) == 1
        if high is None:
            # A sure fit teaches the model a second point; doubling may fail and teach nothing.
            if single and jump > low:
                return min(jump, max(2 * low, grid.floor(_floor(jump * SECOND_POINT))))
            return max(2 * low, jump)
        return jump if single and low < jump < high else None
    predicted, verified = model
    if predicted <= low:
        misses = _upward_misses(attempts, bracket.budget_bytes, grid)
        scale = low if high is None else high - low
        ceiling = 2 * low if high is None else max(midpoint(low, high, grid), low + step)
        return min(low + _gallop(misses, scale, step), ceiling)
    if high is not None and predicted >= high:
        # The line over-estimated: it is too flat, and the boundary is seldom one below the
        # failure, so the gallop down starts at a fifth of the bracket, not at one step (over
        # the property shapes: convex memory 5.9 boundary-steps instead of 6.5, flat starts 6.3
        # instead of 7.2, the rest unchanged).
        fails = _trailing_failures(attempts) + 1
        return max(high - _gallop(fails, high - low, step), midpoint(low, high, grid))
    if verified or not _missed(attempts, bracket.budget_bytes, grid):
        # Until the model has missed, aim at the boundary itself: a fit there and a failure one
        # above is the cheapest possible end. After a miss an unverified line aims short.
        return predicted
    hedged = predicted - grid.floor(_floor(_uncertainty(attempts, bracket.budget_bytes, grid, predicted) * HEDGE))
    return hedged if hedged > low else predicted


def _gallop(misses: int, scale: int, step: int) -> int:
    """How far past a wrong prediction to probe after ``misses`` wrong outcomes in a row.

    One step while the model is merely off by one; after that the distance doubles, starting
    from a tenth of ``scale`` (the bracket), so that a model that is far off costs a couple of
    trials more than bisection (the caller caps gallops at the midpoint), never a crawl.
    """
    if misses == 0:
        return step
    grow = 2 ** (misses - 1)
    return max(step * grow, step * _floor(scale * HEDGE * grow / step))


def _predict(attempts: Sequence[Attempt], budget: int | None, grid: Grid) -> tuple[int, bool] | None:
    """The largest grid size predicted to fit, and whether its line is verified, or ``None``.

    ``None`` when there is no target (no budget and no failure bound) or no series grows.
    """
    target = _target_bytes(attempts, budget)
    if target is None:
        return None
    best: tuple[Fraction, bool] | None = None
    for points in _series(attempts).values():
        line = _growing_line(points)
        if line is None:
            continue
        (x1, y1), (x2, y2), verified = line
        slope = Fraction(y2 - y1, x2 - x1)
        crossing = x2 + (target - y2) / slope
        if best is None or crossing < best[0]:
            best = (crossing, verified)
    if best is None:
        return None
    crossing, verified = best
    return grid.floor(max(0, _floor(crossing))), verified


def _uncertainty(attempts: Sequence[Attempt], budget: int | None, grid: Grid, predicted: int) -> int:
    """How far off an unverified prediction may be: the distance it extrapolates from the
    largest fitting size, or, if smaller, how much the prediction moved when that size was
    added (a line that barely moves on a new point is settling on the truth)."""
    fitted = [index for index, attempt in enumerate(attempts) if attempt.fits]
    low = max(attempts[index].batch_size for index in fitted)
    distance = predicted - low
    before = _predict(attempts[: fitted[-1]], budget, grid)
    if before is not None:
        distance = min(distance, abs(predicted - before[0]))
    return distance


def _target_bytes(attempts: Sequence[Attempt], budget: int | None) -> int | None:
    """The budget, lowered to the smallest failure bound (the device gave up below it).

    Without a budget there is no target: a failure bound alone (live plus requested bytes)
    can sit anywhere between the budget and the size's real need, and aiming at a loose one
    cost more trials than bisection in the tests, so the strategy then proposes what the
    plain one does.
    """
    if budget is None:
        return None
    bounds = [a.peak_bytes for a in attempts if not a.fits and a.peak_bytes is not None]
    return min([budget, *bounds])


def _series(attempts: Sequence[Attempt]) -> dict[str, list[tuple[int, int]]]:
    """Fitting sizes' peaks per series (each phase, and the total), sorted by size."""
    series: dict[str, dict[int, int]] = {}
    for attempt in attempts:
        if not attempt.fits:
            continue
        if attempt.peak_bytes is not None:
            series.setdefault("total", {})[attempt.batch_size] = attempt.peak_bytes
        for phase, peak in attempt.phase_peaks:
            series.setdefault(phase, {})[attempt.batch_size] = peak
    return {name: sorted(by_size.items()) for name, by_size in series.items()}


def _growing_line(
    points: Sequence[tuple[int, int]],
) -> tuple[tuple[int, int], tuple[int, int], bool] | None:
    """The two largest points of the part of a series that grows, and whether a third agrees.

    Walking down from the largest size while the peak keeps falling skips a flat start (the
    optimizer step dominating small batches); a series that does not grow gives ``None``.
    """
    suffix = [points[-1]] if points else []
    for point in reversed(points[:-1]):
        if point[1] >= suffix[-1][1]:
            break
        suffix.append(point)
    if len(suffix) < 2:
        return None
    (x2, y2), (x1, y1) = suffix[0], suffix[1]
    verified = False
    if len(suffix) >= 3:
        x0, y0 = suffix[2]
        expected = y1 + Fraction(y2 - y1, x2 - x1) * (x0 - x1)
        verified = abs(expected - y0) <= COLLINEAR * y0
    return (x1, y1), (x2, y2), verified


def _proportional_jump(attempts: Sequence[Attempt], low: int, budget: int | None, grid: Grid) -> int | None:
    """``low * target / peak(low)``: fits if fixed bytes are >= 0 and memory is affine (or a
    maximum of such lines), because then the peak per sample only falls as the batch grows."""
    target = _target_bytes(attempts, budget)
    peaks = [a.peak_bytes for a in attempts if a.fits and a.batch_size == low and a.peak_bytes]
    if target is None or not peaks:
        return None
    return grid.floor(_floor(Fraction(low * target, peaks[-1])))


def _upward_misses(attempts: Sequence[Attempt], budget: int | None, grid: Grid) -> int:
    """How many of the latest trials fitted although the model before each said they would not."""
    count = 0
    for index in range(len(attempts) - 1, 0, -1):
        attempt = attempts[index]
        if not attempt.fits:
            break
        before = _predict(attempts[:index], budget, grid)
        if before is None or attempt.batch_size <= before[0]:
            break
        count += 1
    return count


def _trailing_failures(attempts: Sequence[Attempt]) -> int:
    count = 0
    for attempt in reversed(attempts):
        if attempt.fits:
            break
        count += 1
    return count


def _floor(value: Fraction) -> int:
    return value.numerator // value.denominator
