"""Properties of the pure search (batchfit/search.py), for both strategies (the interpolating one
in batchfit/interpolate.py, the names in batchfit/strategies.py).

The oracles here are synthetic: a size fits when its memory need is within a budget, and the
need is a function of the batch size (affine, flat-then-linear as when the optimizer step
dominates small batches, convex, concave, or just an unknown threshold). The search must find
the exact boundary on the grid, within ``max_trials(grid)`` oracle calls, whatever the
strategy proposes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from batchfit.errors import NothingFitsError
from batchfit.search import core as S
from batchfit.search import make_strategy
from batchfit.search.interpolate import Interpolating
from batchfit.search.strategies import STRATEGIES

STRATEGY_NAMES = ("binary", "interpolate")


@dataclass(frozen=True)
class Verdict:
    fits: bool
    peak_bytes: int | None = None
    phase_peaks: tuple[tuple[str, int], ...] = ()
    phase: str | None = None


# Oracles ---------------------------------------------------------------------------------------
def threshold_oracle(threshold: int) -> Callable[[int], Verdict]:
    """Fits up to ``threshold``; says nothing about memory."""
    return lambda size: Verdict(size <= threshold)


Need = Callable[[int], int]


def memory_oracle(need: Need, budget: int, failure: str = "barely", phases: Callable[[int], dict] | None = None):
    """Fits when ``need(size) <= budget``. A failure reports a lower bound of the need:
    ``barely`` (just over the budget, as the live-tensor meter does), ``exact`` or ``none``."""

    def oracle(size: int) -> Verdict:
        total = need(size)
        if total <= budget:
            parts = tuple(phases(size).items()) if phases else ()
            return Verdict(True, total, parts)
        bound = {"barely": budget + 1, "exact": total, "none": None}[failure]
        return Verdict(False, bound, (), "forward")

    return oracle


def counting(oracle: Callable[[int], Verdict]) -> tuple[Callable[[int], Verdict], list[int]]:
    calls: list[int] = []

    def wrapped(size: int) -> Verdict:
        calls.append(size)
        return oracle(size)

    return wrapped, calls


def truth_on_grid(grid: S.Grid, threshold: int) -> int:
    """The largest grid size <= threshold (the boundary the search must return)."""
    return min(grid.top, grid.floor(threshold))


# Hypothesis building blocks ----------------------------------------------------------------------
@st.composite
def grids(draw: st.DrawFn, max_maximum: int = 40_000) -> S.Grid:
    multiple_of = draw(st.sampled_from([1, 1, 1, 2, 3, 8, 64]))
    init = multiple_of * draw(st.integers(1, 8))
    maximum = draw(st.integers(init, max(init, max_maximum)))
    return S.Grid(init, maximum, multiple_of)


@st.composite
def memory_functions(draw: st.DrawFn) -> tuple[str, Need, Callable[[int], dict] | None]:
    """Monotone memory needs of the shapes real steps have, with or without per-phase peaks."""
    kind = draw(st.sampled_from(["affine", "flat_then_linear", "convex", "concave", "phased"]))
    fixed = draw(st.integers(0, 10**9))
    per = draw(st.integers(1, 10**7))
    if kind == "affine":
        return kind, (lambda b: fixed + per * b), None
    if kind == "flat_then_linear":
        flat = fixed + per * draw(st.integers(1, 500))
        return kind, (lambda b: max(flat, fixed + per * b)), None
    if kind == "convex":
        knee = draw(st.integers(1, 2000))
        extra = draw(st.integers(1, per))
        return kind, (lambda b: fixed + per * b + extra * max(0, b - knee)), None
    if kind == "concave":
        return kind, (lambda b: fixed + int(per * 3 * b**0.8)), None
    # phased: a flat optimizer step, a forward and a backward line; the total is their maximum
    step_bytes = fixed + per * draw(st.integers(0, 300))
    forward_per = per
    backward_per = draw(st.integers(1, 2 * per))

    def parts(b: int) -> dict[str, int]:
        return {
            "forward": fixed // 2 + forward_per * b,
            "backward": fixed // 3 + backward_per * b,
            "step": step_bytes + b,
        }

    return kind, (lambda b: max(parts(b).values())), parts


def boundary_of(need: Need, budget: int, grid: S.Grid) -> int | None:
    """The exact boundary by a scan over the grid (needs are monotone), None if init fails."""
    if need(grid.init) > budget:
        return None
    low, high = grid.init, grid.top
    while low < high:  # the needs are monotone: bisect the scan
        mid = grid.floor((low + high + grid.multiple_of) // 2)
        mid = max(mid, low + grid.multiple_of)
        if need(mid) <= budget:
            low = mid
        else:
            high = mid - grid.multiple_of
    return low


# Exactness and the trial bound -------------------------------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@settings(max_examples=400, deadline=None)
@given(grid=grids(), data=st.data())
def test_any_monotone_threshold_gives_exact_boundary_within_bound(strategy: str, grid: S.Grid, data) -> None:
    threshold = data.draw(st.integers(grid.init, grid.maximum + 100), label="threshold")
    oracle, calls = counting(threshold_oracle(threshold))
    report = S.search(oracle, grid, make_strategy(strategy), budget_bytes=data.draw(st.none() | st.integers(1, 10**9)))
    expected = truth_on_grid(grid, threshold)
    assert report.largest_fit == expected
    assert len(calls) == len(report.attempts) <= S.max_trials(grid)
    assert all(size % grid.multiple_of == 0 and grid.init <= size <= grid.top for size in calls)
    assert len(set(calls)) == len(calls), "a size was tried twice"
    if expected < grid.top:
        assert report.boundary_reached and report.stop_reason == "boundary"
        assert report.smallest_fail == expected + grid.multiple_of
    else:
        assert not report.boundary_reached and report.stop_reason == "max_batch"
        assert report.smallest_fail is None


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grid=grids(), memory=memory_functions(), data=st.data())
def test_memory_shaped_needs_give_exact_boundary_within_bound(strategy: str, grid: S.Grid, memory, data) -> None:
    _, need, phases = memory
    boundary = data.draw(st.integers(grid.init, grid.top + 50), label="boundary")
    budget = need(boundary) + data.draw(st.integers(0, 3), label="slack")
    failure = data.draw(st.sampled_from(["barely", "exact", "none"]), label="failure")
    give_budget = data.draw(st.booleans(), label="give_budget")
    expected = boundary_of(need, budget, grid)
    assert expected is not None
    oracle, calls = counting(memory_oracle(need, budget, failure, phases))
    report = S.search(oracle, grid, make_strategy(strategy), budget_bytes=budget if give_budget else None)
    assert report.largest_fit == expected
    assert len(calls) <= S.max_trials(grid)
    assert report.boundary_reached == (expected < grid.top)


@settings(max_examples=300, deadline=None)
@given(grid=grids(), data=st.data())
def test_interpolate_without_budget_proposes_what_binary_does(grid: S.Grid, data) -> None:
    fixed, per = data.draw(st.integers(0, 10**8)), data.draw(st.integers(1, 10**6))
    boundary = data.draw(st.integers(grid.init, grid.top + 50))
    budget = fixed + per * boundary
    oracle = memory_oracle(lambda b: fixed + per * b, budget, data.draw(st.sampled_from(["barely", "exact"])))
    plain = S.search(oracle, grid, S.Doubling())
    interpolated = S.search(oracle, grid, Interpolating())
    assert [a.batch_size for a in interpolated.attempts] == [a.batch_size for a in plain.attempts]


@settings(max_examples=300, deadline=None)
@given(
    fixed=st.integers(0, 10**9),
    per=st.integers(1, 10**7),
    boundary=st.integers(1, 30_000),
    failure=st.sampled_from(["barely", "exact", "none"]),
)
def test_interpolate_needs_at_most_five_trials_on_affine_memory(
    fixed: int, per: int, boundary: int, failure: str
) -> None:
    """Exact lines from init=1: init, a sure jump, (a hedged guess), the boundary, one above."""
    grid = S.Grid(1, 32_768)
    budget = fixed + per * boundary
    oracle = memory_oracle(lambda b: fixed + per * b, budget, failure)
    report = S.search(oracle, grid, Interpolating(), budget_bytes=budget)
    assert report.largest_fit == boundary
    assert len(report.attempts) <= 5


def test_interpolate_takes_fewer_trials_on_average() -> None:
    """Over many seeded memory shapes, at most half the plain strategy's trials (the issue's target
    against Lightning's binsearch, which probes like the plain strategy)."""
    rng = random.Random(5)
    plain = smart = 0
    for _ in range(300):
        fixed, per = rng.randint(0, 10**8), rng.randint(1, 10**6)
        flat = fixed + per * rng.randint(1, 50)
        need = (lambda f, p, fl: lambda b: max(fl, f + p * b))(fixed, per, flat)
        boundary = rng.randint(60, 20_000)
        budget = need(boundary)
        grid = S.Grid(1, 32_768)
        oracle = memory_oracle(need, budget)
        plain += len(S.search(oracle, grid, S.Doubling()).attempts)
        report = S.search(oracle, grid, Interpolating(), budget_bytes=budget)
        assert report.largest_fit == boundary_of(need, budget, grid)
        smart += len(report.attempts)
    assert smart * 2 <= plain


def cnn_phases(b: int) -> dict[str, int]:
    n = b - 1
    return {"forward": 382344 + 290816 * n, "backward": 416480 + 323624 * n, "step": 162460 + 12328 * n}


def gpt_phases(b: int) -> dict[str, int]:
    """Not affine at b=1: the backward peak of a single sequence sits above the line."""
    if b == 1:
        return {"forward": 7028744, "backward": 8186888, "step": 8188932}
    n = b - 2
    return {"forward": 8667640 + 1509368 * n, "backward": 8924680 + 1637888 * n, "step": 8188932 + 132096 * (n + 1)}


def mlp_phases(b: int) -> dict[str, int]:
    """The optimizer step is the peak below ~380 samples and grows only by the batch's bytes."""
    n = b - 1
    return {"forward": 7961764 + 13352 * n, "backward": 10599632 + 3112 * n, "step": 12696780 + 1064 * n}


def sample_steps(attempts: tuple[S.Attempt, ...]) -> float:
    """What a search cost in steps times samples: a fit at b runs one step on b samples, a
    failure stops part-way (counted as 0.6 of a step), the first trial runs two steps."""
    return sum((2 if index == 0 else 1 if a.fits else 0.6) * a.batch_size for index, a in enumerate(attempts))


# per-phase peaks measured on this project's built-in examples (torch 2.13, CPU meter)
@pytest.mark.parametrize(("name", "sizes"), [("cnn", cnn_phases), ("gpt", gpt_phases), ("mlp", mlp_phases)])
@pytest.mark.parametrize("boundary", [20, 57, 150, 1000])
@pytest.mark.parametrize("init", [1, 2])
def test_interpolate_on_measured_phase_lines(name: str, sizes, boundary: int, init: int) -> None:
    """The step phase is the peak of small MLP batches (flat): the forward line still predicts.
    From the default init (2) the search is init, a small second point, the boundary and one
    above it. From init=1 the GPT's single sequence sits above its line, the first aim
    overshoots and the search costs more, but still less than the plain one."""

    def need(b: int) -> int:
        return max(sizes(b).values())

    budget = need(boundary)
    grid = S.Grid(init, 32_768)
    smart = S.search(memory_oracle(need, budget, phases=sizes), grid, Interpolating(), budget_bytes=budget)
    plain = S.search(memory_oracle(need, budget, phases=sizes), grid, S.Doubling())
    assert smart.largest_fit == plain.largest_fit == boundary
    assert 2 * len(smart.attempts) <= len(plain.attempts) + 3
    assert sample_steps(smart.attempts) < sample_steps(plain.attempts)
    if init == 2:
        assert len(smart.attempts) <= 4
        assert sample_steps(smart.attempts) <= 1.75 * boundary + 8


@settings(max_examples=300, deadline=None)
@given(
    fixed=st.integers(0, 10**9),
    per=st.integers(1, 10**7),
    boundary=st.integers(100, 30_000),
    failure=st.sampled_from(["barely", "exact", "none"]),
)
def test_interpolate_spends_one_trial_near_an_affine_boundary(
    fixed: int, per: int, boundary: int, failure: str
) -> None:
    """Trials cost sample-steps: on affine memory the only fit near the boundary is the boundary
    itself, the only failure is one above it, and the point that gives the line its slope costs
    at most an eighth of the boundary."""
    grid = S.Grid(2, 1 << 16)
    budget = fixed + per * boundary
    report = S.search(
        memory_oracle(lambda b: fixed + per * b, budget, failure), grid, Interpolating(), budget_bytes=budget
    )
    assert report.largest_fit == boundary
    assert [a.batch_size for a in report.attempts if not a.fits] == [boundary + 1]
    others = [a.batch_size for a in report.attempts if a.fits and a.batch_size not in (grid.init, boundary)]
    assert sum(others) <= boundary // 8 + 2


# Memory that does not explain the failures ------------------------------------------------------
#: How many trials more than the plain strategy the interpolating one may take when the measured
#: peaks say nothing about where sizes fail: at most ``MISSES`` (5) wrong guesses before it stops
#: following its model, then the plain doubling restarted from its largest fit, which can land
#: on a ladder one or two sizes longer than the plain search's (the worst case the property
#: search found, over some 60,000 targeted examples, was 7; before the distrust rule, 16 to 24).
UNRELATED_EXTRA = 8


@st.composite
def unrelated_memory(draw: st.DrawFn, grid: S.Grid) -> tuple[int, int, Callable[[int], Verdict]]:
    """A true threshold, a budget, and an oracle whose peaks are unrelated to that threshold:
    a line that meets the budget anywhere (far above or far below the threshold), or noise.
    Failures report what a real allocator may: just over the budget, nothing, the line's peak,
    or some number below the budget (live bytes when a fragmented device gave up)."""
    threshold = draw(st.integers(grid.init, grid.maximum + 100), label="threshold")
    budget = draw(st.integers(1, 10**12), label="budget")
    peaks = draw(st.sampled_from(["line", "noise"]), label="peaks")
    fixed, per = draw(st.integers(0, 10**9), label="fixed"), draw(st.integers(1, 10**9), label="per")
    failure = draw(st.sampled_from(["barely", "none", "peak", "below"]), label="failure")
    seed = draw(st.integers(0, 2**32), label="seed")

    def peak(size: int) -> int:
        if peaks == "line":
            return fixed + per * size
        return random.Random(seed * 1_000_003 + size).randint(1, 2 * budget)

    def oracle(size: int) -> Verdict:
        if size <= threshold:
            return Verdict(True, peak(size))
        below = random.Random(seed - size).randint(1, budget)
        return Verdict(False, {"barely": budget + 1, "none": None, "peak": peak(size), "below": below}[failure])

    return threshold, budget, oracle


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grid=grids(), data=st.data())
def test_interpolate_stops_following_memory_that_does_not_explain_the_failures(grid: S.Grid, data) -> None:
    """Exact and within the bound whatever the peaks say, and at most UNRELATED_EXTRA trials more
    than the plain strategy: once the trials contradict the model it proposes the plain sizes."""
    threshold, budget, oracle = data.draw(unrelated_memory(grid))
    plain = S.search(oracle, grid, S.Doubling())
    report = S.search(oracle, grid, Interpolating(), budget_bytes=budget)
    assert report.largest_fit == truth_on_grid(grid, threshold)
    assert len(report.attempts) <= S.max_trials(grid)
    assert len(report.attempts) <= len(plain.attempts) + UNRELATED_EXTRA


@pytest.mark.parametrize("threshold", [9333, 9416, 9471])
def test_interpolate_under_a_real_allocator_limit_far_below_the_budget(threshold: int) -> None:
    """The shape of the RLIMIT_AS run (tests/test_real_oom.py): peaks that grow 16.4 KiB a sample
    as measured, a 4 GiB budget the process could never reach, and failures that report a little
    less than the failing size needs (live bytes plus the refused request). Before the distrust
    rule the model aimed at each failure's bound in turn, a little lower each time, and took 42
    trials (the bound; 36 in the real run) where the plain strategy takes 27; now 19. It must
    not take more than the plain one."""
    need = lambda b: 2_150_000 + 16_790 * b  # noqa: E731
    budget = 4 * 2**30

    def oracle(size: int) -> Verdict:
        if size <= threshold:
            return Verdict(True, need(size))
        return Verdict(False, need(size) * (970 + size % 31) // 1000)

    grid = S.Grid(2, 1 << 20)
    plain = S.search(oracle, grid, S.Doubling())
    report = S.search(oracle, grid, Interpolating(), budget_bytes=budget)
    assert report.largest_fit == plain.largest_fit == threshold
    assert len(report.attempts) <= len(plain.attempts)


# Edges: nothing fits, everything fits, should_stop ----------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@given(grid=grids(max_maximum=5000), needed=st.none() | st.integers(1, 10**9))
def test_init_failing_raises_nothing_fits_naming_the_size(strategy: str, grid: S.Grid, needed: int | None) -> None:
    calls: list[int] = []

    def oracle(size: int) -> Verdict:
        calls.append(size)
        return Verdict(False, needed, phase="backward")

    with pytest.raises(NothingFitsError) as raised:
        S.search(oracle, grid, make_strategy(strategy), budget_bytes=1000)
    assert calls == [grid.init]
    assert raised.value.batch_size == grid.init
    assert f"batch size {grid.init} " in str(raised.value)
    assert raised.value.needed_bytes == needed
    assert raised.value.budget_bytes == 1000
    assert raised.value.phase == "backward"


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@settings(deadline=None)
@given(grid=grids(), data=st.data())
def test_nothing_failing_up_to_max_reports_max_batch(strategy: str, grid: S.Grid, data) -> None:
    per = data.draw(st.integers(1, 1000))
    budget = per * (grid.maximum + 1) + data.draw(st.integers(0, 10**6))
    oracle, calls = counting(memory_oracle(lambda b: per * b, budget))
    report = S.search(oracle, grid, make_strategy(strategy), budget_bytes=budget)
    assert report.largest_fit == grid.top
    assert report.smallest_fail is None
    assert not report.boundary_reached
    assert report.stop_reason == "max_batch"
    assert calls[-1] == grid.top
    assert len(calls) <= S.max_trials(grid)


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@given(grid=grids(), threshold=st.integers(1, 50_000), allowed=st.integers(0, 12))
def test_should_stop_ends_the_search_with_what_it_has(
    strategy: str, grid: S.Grid, threshold: int, allowed: int
) -> None:
    assume(threshold >= grid.init)
    consulted = 0

    def should_stop() -> bool:
        nonlocal consulted
        consulted += 1
        return consulted > allowed

    oracle, calls = counting(threshold_oracle(threshold))
    report = S.search(oracle, grid, make_strategy(strategy), should_stop)
    assert len(calls) <= allowed + 1  # the first call happens before should_stop is asked
    assert report.largest_fit <= truth_on_grid(grid, threshold)
    if report.stop_reason == "stopped":
        assert not report.boundary_reached
        assert len(calls) == allowed + 1
    else:
        assert report.largest_fit == truth_on_grid(grid, threshold)


# Non-monotone memory ---------------------------------------------------------------------------------
def test_is_non_monotone_detects_a_failure_below_a_fit() -> None:
    A = S.Attempt
    assert not S.is_non_monotone([A(1, True), A(2, True), A(4, False), A(3, True)])
    assert S.is_non_monotone([A(1, True), A(4, False), A(8, True)])
    assert S.is_non_monotone([A(16, True), A(8, False)])
    assert not S.is_non_monotone([])
    assert not S.is_non_monotone([A(1, False)])
    assert not S.is_non_monotone([A(1, True), A(2, True)])


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@settings(deadline=None)
@given(grid=grids(max_maximum=5000), failing=st.sets(st.integers(1, 5100), max_size=40), data=st.data())
def test_non_monotone_oracle_still_ends_on_a_local_boundary(
    strategy: str, grid: S.Grid, failing: set[int], data
) -> None:
    """Whatever the oracle does, the search stops within the bound on a fit next to a failure."""
    failing.discard(grid.init)
    per = data.draw(st.integers(1, 10**6))
    budget = per * data.draw(st.integers(grid.init, grid.top + 10))

    def oracle(size: int) -> Verdict:
        fits = size not in failing and per * size <= budget * (2 if size % 7 == 0 else 1)
        return Verdict(fits, per * size if fits else budget + 1)

    report = S.search(oracle, grid, make_strategy(strategy), budget_bytes=budget)
    assert len(report.attempts) <= S.max_trials(grid)
    assert oracle(report.largest_fit).fits
    if report.boundary_reached:
        assert not oracle(report.smallest_fail).fits
        assert report.smallest_fail - report.largest_fit == grid.multiple_of


# Clamping of bad proposals ---------------------------------------------------------------------------
class Wild:
    """A strategy that proposes garbage: the search must keep every trial on the grid, inside the
    bracket, and still end exactly."""

    name = "wild"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def propose(self, bracket: S.Bracket) -> int:
        choice = self._rng.randrange(8)
        if choice == 0:
            return -self._rng.randrange(10**6)
        if choice == 1:
            return 10**12
        if choice == 2:
            return bracket.low  # already known to fit
        if choice == 3 and bracket.high is not None:
            return bracket.high  # already known to fail
        if choice == 4:
            return bracket.low + self._rng.random() * 50  # float, off the grid
        if choice == 5:
            return float("inf")
        if choice == 6:
            return float("-inf")
        return bracket.low + self._rng.randrange(1, 100)


@settings(deadline=None)
@given(grid=grids(max_maximum=3000), threshold=st.integers(1, 3100), seed=st.integers(0, 2**32))
def test_bad_proposals_are_clamped_into_the_bracket(grid: S.Grid, threshold: int, seed: int) -> None:
    assume(threshold >= grid.init)
    seen: list[tuple[int, int | None]] = []

    def oracle(size: int) -> Verdict:
        if seen:
            low, high = seen[-1]
            assert low < size and (high is None or size < high), "a proposal left the open bracket"
        assert size % grid.multiple_of == 0 and grid.init <= size <= grid.top
        return Verdict(size <= threshold)

    strategy = Wild(seed)
    original = strategy.propose

    def tracking(bracket: S.Bracket) -> int:
        seen.append((bracket.low, bracket.high))
        return original(bracket)

    strategy.propose = tracking  # type: ignore[method-assign]
    report = S.search(oracle, grid, strategy)
    assert report.largest_fit == truth_on_grid(grid, threshold)


# The bound itself ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("multiple_of", [1, 2, 3, 8])
@pytest.mark.parametrize("init_steps", [1, 3])
def test_max_trials_covers_the_plain_worst_case_exhaustively(multiple_of: int, init_steps: int) -> None:
    for maximum in list(range(init_steps * multiple_of, 300)) + [1023, 1024, 1025, 4096, 32768]:
        grid = S.Grid(init_steps * multiple_of, maximum, multiple_of)
        worst = 1 + S._plain_worst(grid.init, None, grid)
        assert worst <= S.max_trials(grid)
        if maximum < 300:
            for threshold in range(grid.init, maximum + 2):
                report = S.search(threshold_oracle(threshold), grid, S.Doubling())
                assert len(report.attempts) <= worst


def test_max_trials_matches_the_documented_formula() -> None:
    for maximum in (1, 2, 3, 64, 1000, 32768):
        grid = S.Grid(1, maximum)
        assert S.max_trials(grid) == 2 * math.ceil(math.log2(max(maximum, 2))) + 2


# Plumbing ---------------------------------------------------------------------------------------
def test_make_strategy_knows_both_names_and_accepts_objects() -> None:
    assert set(STRATEGIES) == {"binary", "interpolate"}
    assert make_strategy("binary").name == "binary"
    assert make_strategy("interpolate").name == "interpolate"
    custom = Interpolating(budget_bytes=10)
    assert make_strategy(custom) is custom
    with pytest.raises(ValueError, match="unknown search strategy 'smart'.*binary, interpolate"):
        make_strategy("smart")
    with pytest.raises(TypeError, match="propose"):
        make_strategy(object())  # type: ignore[arg-type]


def test_budget_and_phase_peaks_reach_the_strategy() -> None:
    brackets: list[S.Bracket] = []

    class Spy(S.Doubling):
        def propose(self, bracket: S.Bracket) -> int:
            brackets.append(bracket)
            return super().propose(bracket)

    def oracle(size: int) -> Verdict:
        return Verdict(size <= 5, size * 10, (("forward", size * 7), ("step", 3)))

    S.search(oracle, S.Grid(1, 64), Spy(), budget_bytes=55)
    assert brackets and all(b.budget_bytes == 55 for b in brackets)
    first = brackets[0].attempts[0]
    assert first == S.Attempt(1, True, 10, (("forward", 7), ("step", 3)))


def test_constructor_budget_is_used_when_the_search_passes_none() -> None:
    need = lambda b: 1000 + 10 * b  # noqa: E731
    oracle = memory_oracle(need, need(777))
    grid = S.Grid(1, 32_768)
    with_budget = S.search(oracle, grid, Interpolating(budget_bytes=need(777)))
    assert with_budget.largest_fit == 777
    assert len(with_budget.attempts) <= 5
    passed = S.search(oracle, grid, Interpolating(budget_bytes=1), budget_bytes=need(777))
    assert [a.batch_size for a in passed.attempts] == [a.batch_size for a in with_budget.attempts]


def test_search_takes_a_strategy_object_not_a_name() -> None:
    with pytest.raises(TypeError, match="make_strategy"):
        S.search(threshold_oracle(5), S.Grid(1, 64), "binary")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="propose"):
        S.search(threshold_oracle(5), S.Grid(1, 64), object())  # type: ignore[arg-type]
    assert S.search(threshold_oracle(5), S.Grid(1, 64)).strategy == "binary"


def test_search_module_does_not_import_torch() -> None:
    """Nor do the interpolating strategy and the registry; the search's core imports neither of them,
    and interpolate does not import the registry (read from each module's own imports: importing
    any of them runs the package's ``__init__``, which loads all three); the whole package loads
    no torch (checked in a fresh interpreter)."""
    import ast
    import inspect
    import subprocess
    import sys

    import batchfit.search.core
    import batchfit.search.interpolate
    import batchfit.search.strategies

    forbidden = {
        S: ("torch", "batchfit.search.interpolate", "batchfit.search.strategies"),
        batchfit.search.interpolate: ("torch", "batchfit.search.strategies"),
        batchfit.search.strategies: ("torch",),
        batchfit.search: ("torch",),
    }
    for module, absent in forbidden.items():
        tree = ast.parse(inspect.getsource(module))
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
        roots = {name.split(".")[0] for name in imported}
        assert not [name for name in absent if name in imported or name in roots], module.__name__

    for module in ("batchfit.search",):
        code = f"import sys, {module}; print(sorted(m for m in ('torch',) if m in sys.modules))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip() == "[]", f"importing {module} loaded {out.strip()}"
