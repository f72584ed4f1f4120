"""Properties of :func:`batchfit.search.search_near`, the frontier's search from a prediction.

Synthetic oracles, as in ``tests/test_search.py``: a size fits when its memory need (affine,
convex, or an unknown threshold) is within the budget. Whatever the guess and the slope it is
given (right, wrong by far, or absent), the search must return the exact boundary on the grid;
and with a right prediction it must cost two or three trials, which is the point of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.errors import NothingFitsError
from batchfit.search import Grid, search_near


@dataclass(frozen=True)
class Verdict:
    fits: bool
    peak_bytes: int | None = None


def oracle_of(need: Callable[[int], int], budget: int, calls: list[int]) -> Callable[[int], Verdict]:
    def oracle(size: int) -> Verdict:
        calls.append(size)
        total = need(size)
        return Verdict(total <= budget, total if total <= budget else budget + 1)

    return oracle


@settings(max_examples=400, deadline=None)
@given(
    fixed=st.integers(0, 10_000),
    slope=st.integers(1, 5_000),
    curve=st.integers(0, 20),
    budget=st.integers(20_000, 5_000_000),
    multiple_of=st.sampled_from([1, 1, 2, 8]),
    guess_error=st.floats(-0.9, 3.0),
    slope_error=st.floats(0.1, 10.0),
)
def test_exact_boundary_whatever_the_prediction(fixed, slope, curve, budget, multiple_of, guess_error, slope_error):
    def need(b: int) -> int:
        return fixed + slope * b + curve * b * b

    grid = Grid(init=multiple_of, maximum=4096, multiple_of=multiple_of)
    truth = max((b for b in range(grid.init, grid.top + 1, multiple_of) if need(b) <= budget), default=None)
    calls: list[int] = []
    oracle = oracle_of(need, budget, calls)
    guess = (truth or 1) * (1 + guess_error)
    if truth is None:
        with pytest.raises(NothingFitsError):
            search_near(oracle, grid, guess, slope * slope_error, budget)
        return
    report = search_near(oracle, grid, guess, slope * slope_error, budget)
    assert report.largest_fit == truth
    if truth < grid.top:
        assert report.boundary_reached and report.smallest_fail == truth + multiple_of
    else:
        assert report.stop_reason == "max_batch"
    assert len(set(calls)) == len(calls), "no size is tried twice"
    assert len(calls) <= 2 * 13 + 6  # never worse than a few gallops and a bisection


@pytest.mark.parametrize("threshold", [1, 2, 7, 100, 999, 4096])
@pytest.mark.parametrize("guess", [1, 50, 1000, 4096])
def test_without_a_memory_model_it_gallops_and_bisects(threshold, guess):
    calls: list[int] = []

    def oracle(size: int) -> Verdict:
        calls.append(size)
        return Verdict(size <= threshold)

    report = search_near(oracle, Grid(1, 4096), guess, 0.0, None)
    assert report.largest_fit == threshold
    assert len(calls) <= 30


def test_a_right_prediction_costs_three_trials():
    calls: list[int] = []
    need = lambda b: 1_000 + 300 * b  # noqa: E731
    report = search_near(oracle_of(need, 100_000, calls), Grid(2, 4096), 330.0, 300.0, 100_000)
    assert (report.largest_fit, calls) == (330, [323, 330, 331])


def test_a_prediction_a_few_percent_off_costs_three_or_four():
    for guess in (320.0, 325.0, 336.0, 340.0):
        calls: list[int] = []
        need = lambda b: 1_000 + 300 * b  # noqa: E731
        report = search_near(oracle_of(need, 100_000, calls), Grid(2, 4096), guess, 300.0, 100_000)
        assert report.largest_fit == 330
        assert len(calls) <= 4, (guess, calls)


def test_nothing_fits_is_the_searchs_error():
    with pytest.raises(NothingFitsError):
        search_near(lambda b: Verdict(False, 10), Grid(1, 64), 20.0, 1.0, 5)


def test_an_anchor_that_fits_is_the_first_measured_point():
    """The frontier opens a length with the safe batch's verification: a fit there leaves only the
    boundary and one more to try when memory is linear and the slope is right."""
    calls: list[int] = []
    anchored: list[int] = []
    need = lambda b: 1_000 + 300 * b  # noqa: E731

    def verify(size: int) -> Verdict:
        anchored.append(size)
        return Verdict(True, need(size))

    report = search_near(oracle_of(need, 100_000, calls), Grid(2, 4096), 330.0, 300.0, 100_000, anchor=(297, verify))
    assert report.largest_fit == 330 and report.boundary_reached
    assert (anchored, calls) == ([297], [330, 331])


@settings(max_examples=200, deadline=None)
@given(
    threshold=st.integers(2, 3000),
    anchor=st.integers(2, 4096),
    anchor_fits=st.booleans(),
    guess=st.floats(1, 5000),
)
def test_any_anchor_keeps_the_search_exact(threshold, anchor, anchor_fits, guess):
    """An anchor that fits (below the boundary, as a verification under a lower cap is) or fails
    (under its lower cap, which says nothing about the budget) never costs exactness."""
    need = lambda b: 500 + 40 * b  # noqa: E731
    budget = need(threshold)
    anchor = min(anchor, threshold) if anchor_fits else anchor
    verdict = Verdict(anchor_fits, need(anchor) if anchor_fits else None)
    calls: list[int] = []
    report = search_near(
        oracle_of(need, budget, calls), Grid(2, 4096), guess, 40.0, budget, anchor=(anchor, lambda b: verdict)
    )
    assert report.largest_fit == threshold
    assert threshold == 4096 or report.smallest_fail == threshold + 1
