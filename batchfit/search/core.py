"""The search's core: its types, the loop over an oracle, the plain strategy and its trial bound.

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
plug in through [`Strategy`][batchfit.search.core.Strategy]; the search clamps whatever they propose into the open
bracket on the grid, so a strategy can cost trials but never break exactness, and
[`affordable`][batchfit.search.core.affordable] tells a strategy whether a guess keeps the worst case within
[`max_trials`][batchfit.search.core.max_trials].

Where the strategies live: the plain one, [`Doubling`][batchfit.search.core.Doubling], is here, as
[`search`][batchfit.search.core.search]'s default. The interpolating one is
[`batchfit.search.interpolate.Interpolating`][batchfit.search.interpolate.Interpolating], built on
this module's types. The names users pass (``"binary"``, ``"interpolate"``) are looked up in
`batchfit.search.strategies`, apart from both: [`search`][batchfit.search.core.search] takes a
strategy object, so this module needs no registry and never imports the strategies built on it, and
``batchfit.search.interpolate`` imports only this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from batchfit.errors import NothingFitsError

__all__ = [
    "Attempt",
    "Bracket",
    "Doubling",
    "Grid",
    "SearchReport",
    "StopReason",
    "Strategy",
    "Verdict",
    "affordable",
    "clamp",
    "is_non_monotone",
    "max_trials",
    "midpoint",
    "search",
]

#: Why a search ended: the exact boundary was found, everything up to the maximum fitted, or
#: ``should_stop`` asked to stop.
StopReason = Literal["boundary", "max_batch", "stopped"]


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


@dataclass(frozen=True)
class SearchReport:
    """The outcome of a search.

    Attributes:
        largest_fit: the largest size that fitted (``None`` never happens: the search raises
            [`NothingFitsError`][batchfit.NothingFitsError] instead).
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
    stop_reason: StopReason
    strategy: str


def search(
    oracle: Callable[[int], Verdict],
    grid: Grid,
    strategy: Strategy | None = None,
    should_stop: Callable[[], bool] | None = None,
    *,
    budget_bytes: int | None = None,
) -> SearchReport:
    """Find the largest size on ``grid`` for which ``oracle(size).fits`` is true.

    ``strategy`` is a [`Strategy`][batchfit.search.core.Strategy] object (``None``:
    [`Doubling`][batchfit.search.core.Doubling], the plain one); to
    pass a name (``"binary"``, ``"interpolate"``) look it up with
    [`batchfit.search.strategies.make_strategy`][batchfit.search.strategies.make_strategy] first.
    Raises [`NothingFitsError`][batchfit.NothingFitsError] when ``grid.init`` itself does not fit.
    ``should_stop`` is consulted before every call after the first; when it returns true the
    search ends with what it has (``stop_reason="stopped"``). ``budget_bytes`` (the memory the
    trials may use, on the scale of the verdicts' ``peak_bytes``) is handed to the strategy;
    the plain strategy ignores it, the interpolating one aims at it.
    """
    chooser: Strategy = Doubling() if strategy is None else strategy
    if not callable(getattr(chooser, "propose", None)):
        raise TypeError(
            "strategy must be an object with a propose(bracket) method"
            + ("; look names up with batchfit.search.strategies.make_strategy" if isinstance(chooser, str) else "")
        )
    attempts: list[Attempt] = []
    low, high, size = grid.init, None, grid.init
    top = grid.top
    while True:
        # The oracle is called here, not through a helper: the path from `find` to the model stays short.
        verdict = oracle(size)
        phases = tuple((str(p), int(b)) for p, b in getattr(verdict, "phase_peaks", None) or ())
        attempts.append(Attempt(size, bool(verdict.fits), verdict.peak_bytes, phases))
        if verdict.fits:
            low = size
        elif len(attempts) == 1:
            raise NothingFitsError(
                grid.init,
                needed_bytes=verdict.peak_bytes,
                budget_bytes=budget_bytes,
                phase=getattr(verdict, "phase", None),
            )
        else:
            high = size
        if high is None and low >= top:
            return _report(low, high, attempts, grid, "max_batch", chooser)
        if high is not None and high - low <= grid.multiple_of:
            return _report(low, high, attempts, grid, "boundary", chooser)
        if should_stop is not None and should_stop():
            return _report(low, high, attempts, grid, "stopped", chooser)
        bracket = Bracket(low, high, tuple(attempts), grid, budget_bytes)
        size = clamp(chooser.propose(bracket), low, high, grid)


def clamp(proposal: int, low: int, high: int | None, grid: Grid) -> int:
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
    reason: StopReason,
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


def affordable(bracket: Bracket, size: int) -> bool:
    """Whether trying ``size`` keeps the search within [`max_trials`][batchfit.search.core.max_trials] in the worst
    case.

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
