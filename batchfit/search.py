"""The search for the largest batch size that fits: pure logic over an oracle.

This module never imports torch. It asks an *oracle* "does batch size ``b`` fit?" and
decides which size to ask next, so it can be tested exhaustively against synthetic
thresholds (see ``tests/test_search.py``).

The plain strategy is the classic one, done carefully:

1. **Grow** exponentially from ``init`` (``init``, ``2*init``, ``4*init``, ...) until a size
   fails or ``maximum`` is reached (``maximum`` itself is always tried before giving up).
2. **Bisect** between the largest size that fitted and the smallest size that failed, on the
   grid of multiples of ``multiple_of``, until the two are neighbours on that grid.

When memory grows monotonically with batch size this returns the exact boundary in at most
``2 * ceil(log2(maximum)) + 2`` oracle calls. Strategies that choose smarter split points
plug in through :class:`Strategy`; the search clamps whatever they propose into the open
bracket on the grid, so a strategy can cost trials but never break exactness.

The second strategy, ``"interpolate"`` (:class:`Interpolating`), uses the memory the trials
measured: it fits ``peak = fixed + per_sample * b`` per phase of the step and proposes the size
where the fitted line meets the budget, then closes the bracket right next to it. It falls
back to the plain proposal whenever its own guess could push the search past
:func:`max_trials`, so it keeps the plain strategy's worst-case bound (see its docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Protocol

from batchfit.errors import NothingFitsError


class Verdict(Protocol):
    """What the oracle answers for one batch size."""

    @property
    def fits(self) -> bool: ...

    @property
    def peak_bytes(self) -> int | None: ...


@dataclass(frozen=True)
class Attempt:
    """One oracle call as the search saw it.

    ``peak_bytes``: the trial's peak when it fitted; for a failed trial the memory that was
    live plus the failing request (a lower bound of what the size needs), or ``None``.
    ``phase_peaks``: ``(phase, bytes)`` pairs when the oracle measured per phase (forward,
    backward, step...); the interpolating strategy fits one line per phase, because the
    total peak of small batches is often the flat optimizer step.
    """

    batch_size: int
    fits: bool
    peak_bytes: int | None = None
    phase_peaks: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Grid:
    """The sizes the search may try: multiples of ``multiple_of`` in ``[init, maximum]``."""

    init: int
    maximum: int
    multiple_of: int = 1

    def __post_init__(self) -> None:
        for name in ("init", "maximum", "multiple_of"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.init % self.multiple_of:
            raise ValueError(f"init_batch={self.init} must be a multiple of multiple_of={self.multiple_of}")
        if self.maximum < self.init:
            raise ValueError(f"max_batch={self.maximum} is smaller than init_batch={self.init}")

    @property
    def top(self) -> int:
        """The largest size on the grid (``maximum`` rounded down to ``multiple_of``)."""
        return self.maximum - self.maximum % self.multiple_of

    def floor(self, size: int) -> int:
        """Round ``size`` down onto the grid."""
        return size - size % self.multiple_of


@dataclass(frozen=True)
class Bracket:
    """What is known so far: ``low`` fitted, ``high`` failed (``None``: nothing failed yet).

    ``budget_bytes`` is the memory the trials may use, on the scale of ``peak_bytes``, when the
    caller knows it (``None`` otherwise); strategies that model memory use it as their target.
    """

    low: int
    high: int | None
    attempts: tuple[Attempt, ...]
    grid: Grid
    budget_bytes: int | None = None


class Strategy(Protocol):
    """Chooses the next size to try. ``name`` is recorded in results."""

    name: str

    def propose(self, bracket: Bracket) -> int:
        """Return the next size to try; the search clamps it into the open bracket."""
        ...


class Doubling:
    """Plain strategy: double while nothing has failed, then take the grid midpoint."""

    name = "binary"

    def propose(self, bracket: Bracket) -> int:
        if bracket.high is None:
            return bracket.low * 2
        return midpoint(bracket.low, bracket.high, bracket.grid)


def midpoint(low: int, high: int, grid: Grid) -> int:
    """The grid point halfway between ``low`` and ``high`` (both on the grid, ``high > low``)."""
    steps = (high - low) // grid.multiple_of
    return low + (steps // 2) * grid.multiple_of


#: How far below the predicted boundary an unverified prediction aims (a fraction of the
#: distance from the largest fitting size). Lines fitted through the smallest sizes tend to
#: under-estimate the slope (the peak of a tiny batch sits on a different phase or on a
#: kink), so the prediction overshoots; a failure above the boundary teaches the model
#: nothing, while a fit just below it gives a point that pins the line down.
HEDGE = Fraction(1, 10)

#: A third point within this fraction of the line through the two largest ones makes the
#: line "verified" (memory is affine there) and the strategy aims at the boundary itself.
COLLINEAR = Fraction(1, 500)


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

    * one fitting size and a budget: the proportional jump ``low * budget / peak(low)``, which
      fits whenever the peak per sample does not grow with the batch (fixed bytes are >= 0);
      a sure fit gives the second point a line needs, where doubling may fail and give none.
      If the jump is not above ``low``, double;
    * a prediction above ``low``: ``p`` itself when a third point confirms the line, else
      short of it by 10% (:data:`HEDGE`) of how uncertain it is (the distance it extrapolates,
      or how far the last new point moved it, whichever is smaller);
    * a prediction at or below ``low`` (the model says ``low`` is the boundary): ``low + step``
      to confirm, then galloping up (10%, 20%, ... of the bracket) while such predictions keep
      being wrong;
    * a prediction at or above a failed ``high`` (the model over-estimates): ``high - step``,
      then galloping down while sizes keep failing; gallops never pass the bracket's midpoint;
    * no usable prediction: the plain proposal (double, or the midpoint).

    With exact memory lines this finds the boundary in about four or five trials. Its worst
    case stays within :func:`max_trials`: a guess is only taken if, whichever way it comes out,
    the plain strategy could still finish within the bound from there; otherwise the plain
    proposal is used.
    """

    name = "interpolate"

    def __init__(self, budget_bytes: int | None = None) -> None:
        #: Used when the search hands no budget (``bracket.budget_bytes`` wins when it does).
        self.budget_bytes = budget_bytes

    def propose(self, bracket: Bracket) -> int:
        if bracket.budget_bytes is None and self.budget_bytes is not None:
            bracket = replace(bracket, budget_bytes=self.budget_bytes)
        plain = Doubling().propose(bracket)
        guess = _interpolated_guess(bracket)
        if guess is None:
            return plain
        guess = _clamp(guess, bracket.low, bracket.high, bracket.grid)
        if not _affordable(bracket, guess):
            return plain
        return guess


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
            return jump if single and jump > low else max(2 * low, jump)
        return jump if single and low < jump < high else None
    predicted, verified = model
    if predicted <= low:
        misses = _upward_misses(attempts, bracket.budget_bytes, grid)
        scale = low if high is None else high - low
        ceiling = 2 * low if high is None else max(midpoint(low, high, grid), low + step)
        return min(low + _gallop(misses, scale, step), ceiling)
    if high is not None and predicted >= high:
        fails = _trailing_failures(attempts)
        return max(high - _gallop(fails, high - low, step), midpoint(low, high, grid))
    if verified:
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


def _affordable(bracket: Bracket, size: int) -> bool:
    """Whether trying ``size`` keeps the search within :func:`max_trials` in the worst case.

    After the trial, the plain strategy must be able to finish from either outcome's bracket.
    As long as this holds before each trial, the plain proposal keeps it true, so the whole
    search stays within the bound (the plain search from ``init`` does, see the tests).
    """
    low, high, grid = bracket.low, bracket.high, bracket.grid
    worst = max(_plain_worst(size, high, grid), _plain_worst(low, size, grid))
    return len(bracket.attempts) + 1 + worst <= max_trials(grid)


def _plain_worst(low: int, high: int | None, grid: Grid) -> int:
    """Worst-case number of further trials the plain strategy needs from ``(low, high)``."""
    step = grid.multiple_of
    if high is not None:
        return max(0, ((high - low) // step - 1).bit_length())
    if low >= grid.top:
        return 0
    upper = min(2 * low, grid.top)
    return 1 + max(_plain_worst(upper, None, grid), _plain_worst(low, upper, grid))


STRATEGIES: dict[str, Callable[[], Strategy]] = {"binary": Doubling, "interpolate": Interpolating}


def make_strategy(name_or_strategy: str | Strategy) -> Strategy:
    """Look up a strategy by name, or accept an object that has ``propose``."""
    if isinstance(name_or_strategy, str):
        try:
            return STRATEGIES[name_or_strategy]()
        except KeyError:
            known = ", ".join(sorted(STRATEGIES))
            raise ValueError(f"unknown search strategy {name_or_strategy!r}; known: {known}") from None
    if not callable(getattr(name_or_strategy, "propose", None)):
        raise TypeError("strategy must be a name or an object with a propose(bracket) method")
    return name_or_strategy


@dataclass(frozen=True)
class SearchReport:
    """The outcome of a search.

    Attributes:
        largest_fit: the largest size that fitted (``None`` never happens: the search raises
            :class:`NothingFitsError` instead).
        smallest_fail: the smallest size that failed, ``None`` if none did.
        attempts: every oracle call in order.
        boundary_reached: ``True`` when ``largest_fit`` and ``smallest_fail`` are grid
            neighbours, i.e. the exact boundary was found.
        stop_reason: ``"boundary"``, ``"max_batch"`` (everything up to the maximum fitted) or
            ``"stopped"`` (``should_stop`` asked to stop, e.g. a time budget ran out).
    """

    largest_fit: int
    smallest_fail: int | None
    attempts: tuple[Attempt, ...]
    boundary_reached: bool
    stop_reason: str
    strategy: str


def search(
    oracle: Callable[[int], Verdict],
    grid: Grid,
    strategy: str | Strategy = "binary",
    should_stop: Callable[[], bool] | None = None,
    *,
    budget_bytes: int | None = None,
) -> SearchReport:
    """Find the largest size on ``grid`` for which ``oracle(size).fits`` is true.

    Raises :class:`NothingFitsError` when ``grid.init`` itself does not fit.
    ``should_stop`` is consulted before every call after the first; when it returns true the
    search ends with what it has (``stop_reason="stopped"``). ``budget_bytes`` (the memory the
    trials may use, on the scale of the verdicts' ``peak_bytes``) is handed to the strategy;
    the plain strategy ignores it, the interpolating one aims at it.
    """
    chooser = make_strategy(strategy)
    attempts: list[Attempt] = []

    def ask(size: int) -> Verdict:
        verdict = oracle(size)
        phases = tuple((str(p), int(b)) for p, b in getattr(verdict, "phase_peaks", None) or ())
        attempts.append(Attempt(size, bool(verdict.fits), verdict.peak_bytes, phases))
        return verdict

    first = ask(grid.init)
    if not first.fits:
        raise NothingFitsError(
            grid.init,
            needed_bytes=first.peak_bytes,
            budget_bytes=budget_bytes,
            phase=getattr(first, "phase", None),
        )

    low, high = grid.init, None
    top = grid.top
    while True:
        if high is None and low >= top:
            return _report(low, high, attempts, grid, "max_batch", chooser)
        if high is not None and high - low <= grid.multiple_of:
            return _report(low, high, attempts, grid, "boundary", chooser)
        if should_stop is not None and should_stop():
            return _report(low, high, attempts, grid, "stopped", chooser)
        bracket = Bracket(low, high, tuple(attempts), grid, budget_bytes)
        size = _clamp(chooser.propose(bracket), low, high, grid)
        if ask(size).fits:
            low = size
        else:
            high = size


def _clamp(proposal: int, low: int, high: int | None, grid: Grid) -> int:
    """Put a proposal on the grid strictly inside ``(low, high)`` (``high=None``: up to top)."""
    step = grid.multiple_of
    upper = grid.top if high is None else high - step
    try:
        proposal = grid.floor(int(proposal))
    except OverflowError:  # an infinite float: take the nearer end of the bracket
        proposal = upper if proposal > 0 else low
    return max(low + step, min(proposal, upper))


def _report(
    low: int,
    high: int | None,
    attempts: list[Attempt],
    grid: Grid,
    reason: str,
    chooser: Strategy,
) -> SearchReport:
    reached = high is not None and high - low <= grid.multiple_of
    return SearchReport(low, high, tuple(attempts), reached, reason, chooser.name)


def is_non_monotone(attempts: Sequence[Attempt]) -> bool:
    """True when some size failed although a larger size fitted (e.g. cuDNN algorithm choice)."""
    fitted = [a.batch_size for a in attempts if a.fits]
    failed = [a.batch_size for a in attempts if not a.fits]
    return bool(fitted and failed and min(failed) < max(fitted))


def max_trials(grid: Grid) -> int:
    """The plain strategy's worst-case number of oracle calls on ``grid``."""
    span = max(grid.maximum, 2)
    return 2 * (span - 1).bit_length() + 2
