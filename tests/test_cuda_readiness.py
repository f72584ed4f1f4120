"""The CUDA path's defects that a CPU can show (issue 20), through the model of the caching allocator.

``batchfit.estimate(..., device="cuda")`` runs the same search, safe batch and verification code
as a probe on a GPU, over a fake trace counted by the allocator model: what it gets wrong there,
a GPU run gets wrong too. Each test reproduces one defect and shows it fixed:

* the safe batch sized from reserved peaks that pile up at the cap (a caching allocator frees its
  cache only when it reaches the cap), and the headroom checked by what it means;
* the layout the optimizer state kept between trials carries (a fresh process fragments more);
* the throughput timed on a cold first step, CUDA graphs detected, the budget's cap lowered for
  one trial and put back.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import batchfit
from batchfit import examples
from batchfit.probe.compiled import compiled_info
from batchfit.search import Attempt, Grid, SearchReport, confirm_from_scratch

MiB, GiB = 2**20, 2**30


# 1. The safe batch: fitted on what predicts, verified under (1 - headroom) x budget -------------------
@pytest.fixture(scope="module")
def gpt_at_1gib() -> batchfit.Result:
    """The logits kept through backward (``loss_fn``), the workload these defects were found on.
    With the model's own loss the output is freed before backward (issue 32): the largest sizes
    then fit without reaching the cap, so nothing piles up there to show the defect. (Its equation
    is fitted on the top three sizes, whose reserved bytes bend: 358 MiB + 1.0 MiB x batch against
    72 MiB + 1.57 MiB kept; left open by issue 32.)"""
    model, sample = examples.gpt()
    kept = {"loss_fn": lambda output, batch: output["loss"]}
    return batchfit.estimate(model, sample, memory_limit="1GiB", reserve=0, device="cuda", **kept)


def test_reserved_peaks_pile_up_at_the_cap_near_the_boundary(gpt_at_1gib: batchfit.Result) -> None:
    """The defect itself: near the boundary every size reserves about the cap, whatever it needs."""
    result = gpt_at_1gib
    near = [t for t in result.search_trials if t.fits and t.batch_size >= 0.9 * result.max_batch]
    assert len(near) >= 2
    reserved = [t.reserved_peak_bytes for t in near]
    allocated = [t.peak_bytes for t in near]
    assert max(reserved) - min(reserved) < 16 * MiB < max(allocated) - min(allocated)
    assert all(r > result.budget_bytes - 20 * MiB for r in reserved)


def test_the_equation_is_fitted_on_trials_that_did_not_press_against_the_cap(gpt_at_1gib: batchfit.Result) -> None:
    result = gpt_at_1gib
    assert result.memory is not None and result.memory.unit == "reserved"
    free = [
        t for t in result.search_trials if t.fits and t.reserved_peak_bytes < result.budget_bytes - 20 * MiB
    ]
    assert len({t.batch_size for t in free}) >= 2
    for trial in free:  # the line predicts the sizes below the boundary (it overstated them by 4%)
        assert result.memory.predict(trial.batch_size) == pytest.approx(trial.reserved_peak_bytes, rel=0.01)


def test_the_safe_batch_runs_under_the_budget_less_its_headroom(gpt_at_1gib: batchfit.Result) -> None:
    result = gpt_at_1gib
    cap = math.floor(result.budget_bytes * (1 - result.settings.headroom))
    verifies = [t for t in result.trials if t.kind == "verify"]
    assert verifies and all(t.cap_bytes == cap for t in verifies)
    assert result.safe_verified
    final = verifies[-1]
    assert final.fits and final.batch_size == result.safe_batch and final.reserved_peak_bytes <= cap
    # It was 462 of 592 (78%), verified at 80% of the budget; it is now within a few percent of
    # the largest size whose allocated peak stays under the cap.
    below_cap = [t.batch_size for t in result.search_trials if t.fits and t.peak_bytes <= cap]
    assert result.safe_batch >= 0.85 * result.max_batch
    assert result.safe_batch >= 0.95 * max(below_cap) or result.safe_batch >= max(below_cap)
    # A capped verification that fails is no evidence about the budget.
    assert not result.non_monotone


def test_a_capped_trial_fails_above_the_cap_and_the_budget_comes_back() -> None:
    model, sample = examples.mlp()
    with batchfit.Prober(model, sample, memory_limit="64MiB") as prober:
        whole = prober.trial(64)
        assert whole.fits and whole.peak_bytes is not None
        capped = prober.trial(64, cap_bytes=whole.peak_bytes - 1)
        assert not capped.fits
        assert prober.trial(64, cap_bytes=whole.peak_bytes).fits
        assert prober.meter is not None and prober.meter.budget_bytes == 64 * MiB
        assert prober.trial(64).fits


# 5. The layout carried by the optimizer kept between trials -------------------------------------------
@pytest.mark.slow
def test_the_largest_batch_is_the_one_a_fresh_process_trains_at() -> None:
    """GPT-2-small bf16 under 24 GiB in the allocator model: with the AdamW state kept from the
    first (small) trial, batch 22 fitted; a fresh process carves the state out of its own first
    step's activations and fits only 19. The probe now confirms its largest fit from scratch."""
    model, sample = examples.gpt2_small()
    kwargs = {"memory_limit": "24GiB", "reserve": 0, "device": "cuda", "amp": "bf16"}
    result = batchfit.estimate(model, sample, **kwargs)
    kept_fits = [t.batch_size for t in result.search_trials if t.fits]
    assert max(kept_fits) > result.max_batch, "the kept layout no longer differs: this test lost its case"
    assert any("from scratch" in note for note in result.notes)
    fresh = batchfit.estimate(model, sample, init_batch=result.max_batch, max_batch=result.max_batch, **kwargs)
    assert fresh.max_batch == result.max_batch
    with pytest.raises(batchfit.NothingFitsError):
        batchfit.estimate(model, sample, init_batch=result.max_batch + 1, max_batch=result.max_batch + 1, **kwargs)


def _report(largest: int, smallest_fail: int | None) -> SearchReport:
    return SearchReport(largest, smallest_fail, (), smallest_fail == largest + 1, "boundary", "binary")


@pytest.mark.parametrize(("kept", "scratch"), [(k, s) for k in range(2, 30, 3) for s in range(1, 40, 2)])
def test_confirm_from_scratch_finds_the_boundary_from_scratch_on_both_sides(kept: int, scratch: int) -> None:
    """Whether the boundary from scratch lies below the search's (a fresh process fragments more) or above
    it (less): the answer is a fit and a failure from scratch, neighbours, in few trials."""
    grid = Grid(1, 64)
    calls: list[int] = []

    def from_scratch(size: int) -> Attempt:
        calls.append(size)
        return Attempt(size, size <= scratch)

    report = confirm_from_scratch(_report(kept, kept + 1), grid, from_scratch, 1)
    assert (report.largest_fit, report.smallest_fail) == (scratch, scratch + 1)
    assert report.boundary_reached
    assert calls[0] == kept
    assert calls[:2] == [kept, kept + 1] or scratch < kept  # both sides of the search's boundary
    assert scratch in calls and scratch + 1 in calls  # the answer's two sides were seen from scratch
    assert len(calls) <= 2 + 2 * math.ceil(math.log2(abs(kept - scratch) + 1))
    assert [a.batch_size for a in report.attempts] == calls


def test_confirm_from_scratch_answers_a_pair_seen_from_scratch_when_outcomes_are_not_monotone() -> None:
    """The gate's second H200 run: 68 fitted warm and failed from scratch, 63 failed, 61 fitted, 62 failed."""
    fits = {62: False, 63: False, 61: True} | {size: size <= 60 for size in range(1, 61)}
    report = confirm_from_scratch(_report(68, 69), Grid(1, 128), lambda s: Attempt(s, fits.get(s, False)), 1)
    seen = {a.batch_size: a.fits for a in report.attempts}
    assert seen[report.largest_fit] is True and seen[report.smallest_fail] is False
    assert report.smallest_fail == report.largest_fit + 1


def test_confirm_from_scratch_stops_at_the_grid_top() -> None:
    """Every size above the search's boundary fits from scratch up to max_batch: the answer is the top."""
    report = confirm_from_scratch(_report(20, 21), Grid(1, 32), lambda s: Attempt(s, True), 1)
    assert (report.largest_fit, report.smallest_fail, report.stop_reason) == (32, None, "max_batch")


def test_confirm_from_scratch_on_a_coarse_grid() -> None:
    grid = Grid(8, 512, multiple_of=8)
    for kept, scratch in itertools.product(range(16, 512, 40), range(8, 512, 24)):
        top = kept - kept % 8
        report = confirm_from_scratch(_report(top, top + 8), grid, lambda s, limit=scratch: Attempt(s, s <= limit), 8)
        expected = scratch - scratch % 8
        assert report.largest_fit == expected, (kept, scratch)
        assert report.smallest_fail == expected + 8


# 7 and 8. The timed step, and CUDA graphs -----------------------------------------------------------------
def test_cuda_graph_modes_are_detected() -> None:
    assert compiled_info(torch.compile(torch.nn.Linear(2, 2), mode="reduce-overhead")).cudagraphs
    assert compiled_info(torch.compile(torch.nn.Linear(2, 2), mode="max-autotune")).cudagraphs
    assert not compiled_info(torch.compile(torch.nn.Linear(2, 2))).cudagraphs
    assert not compiled_info(torch.compile(torch.nn.Linear(2, 2), mode="max-autotune-no-cudagraphs")).cudagraphs


def test_the_cpu_times_its_single_step_and_runs_no_extra_one() -> None:
    """Only where the first step after a release runs cold (CUDA) does a trial add a warm step."""
    model, sample = examples.mlp()
    result = batchfit.find(model, sample, memory_limit="64MiB", max_batch=256, verify_steps=0)
    later = [t for t in result.search_trials[1:] if t.fits]
    assert later and all(t.steps == 1 and len(t.step_times_s) == 1 for t in later)
