"""Throughput that compares like with like: the sizes the answer depends on are timed warm, alike.

Nothing here asserts a time: the tests check *which* steps the rates come from (warm ones, the
same number per size) and how the knee's neighbourhood is chosen, on real probes and on the pure
rules.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import batchfit
from batchfit import examples
from batchfit.probe.timing import KNEE_BRACKET, MIN_TIMING_S, next_knee_size, time_warm, timing_deadline
from batchfit.report import Throughput, Trial
from batchfit.report.throughput import KNEE_FRACTION, is_warm, warm_rates
from batchfit.search import Grid


def _trial(batch: int, times: tuple[float, ...], steps: int, kind: str = "search") -> Trial:
    median = sorted(times)[len(times) // 2]
    return Trial(
        batch_size=batch,
        fits=True,
        kind=kind,  # type: ignore[arg-type]
        steps=steps,
        step_times_s=times,
        step_time_s=median,
        samples_per_s=batch / median,
    )


def test_a_cold_step_is_never_ranked_against_warm_ones() -> None:
    # The search's single step at 160 is cold and looks slow; the verification's at 144 are warm.
    cold, verified = _trial(160, (1.0,), steps=1), _trial(144, (0.36, 0.37), steps=3, kind="verify")
    mixed = Throughput.of([cold, verified])
    assert mixed is not None and mixed.warm
    assert dict(mixed.rates).keys() == {144}  # the cold 160 is left out, not ranked below 144
    assert not is_warm(cold) and is_warm(verified)
    # Without any warm size, the search's own steps are all there is, and the answer says so.
    only_cold = Throughput.of([cold, _trial(80, (0.4,), steps=1)])
    assert only_cold is not None and not only_cold.warm and dict(only_cold.rates).keys() == {80, 160}


def test_warm_steps_of_one_size_are_pooled() -> None:
    trials = [_trial(64, (0.2, 0.4), steps=3, kind="verify"), _trial(64, (0.3, 0.3), steps=3, kind="time")]
    assert warm_rates(trials) == {64: pytest.approx(64 / 0.3)}
    throughput = Throughput.of(trials)
    assert throughput is not None and throughput.spread == pytest.approx((0.4 - 0.2) / 0.3)


def _pin(curve: dict[int, float], grid: Grid, start: list[int]) -> tuple[dict[int, float], list[int]]:
    """Run the knee's neighbourhood rule against a rate curve, as ``time_warm`` does."""
    rates = {size: curve[size] for size in start}
    asked: list[int] = []
    while (size := next_knee_size(rates, grid)) is not None:
        assert size not in rates, "a size already timed is never asked again"
        asked.append(size)
        rates[size] = curve[size]
        assert len(asked) < 64
    return rates, asked


@pytest.mark.parametrize("saturation", [1, 3, 17, 40, 100, 300])
@pytest.mark.parametrize("multiple_of", [1, 8])
def test_the_knee_is_bracketed_on_any_saturating_curve(saturation: int, multiple_of: int) -> None:
    grid = Grid(init=multiple_of if multiple_of > 1 else 2, maximum=4096, multiple_of=multiple_of)
    top = grid.floor(1000)
    curve = {b: 1000.0 * b / (b + saturation) for b in range(1, 4097)}  # rates that saturate
    rates, asked = _pin(curve, grid, [top, grid.floor(900)])
    best = max(rates.values())
    knee = min(size for size, rate in rates.items() if rate >= KNEE_FRACTION * best)
    below = [size for size in rates if size < knee]
    if below:  # a slower size right below the knee, within the bracket or with no grid size between
        lower = max(below)
        assert curve[lower] < KNEE_FRACTION * best
        assert knee <= KNEE_BRACKET * lower or grid.floor(int((lower * knee) ** 0.5)) <= lower
    else:  # nothing smaller to time
        assert knee == grid.init or grid.floor(knee // 2) in (knee, grid.init) and grid.init in rates
    assert len(asked) <= 2 * 12  # halving, then bisection: logarithmic in the sizes


def test_the_rule_stops_on_any_small_grid() -> None:
    for init, maximum, multiple_of in itertools.product([1, 2, 3], [3, 5, 17], [1, 2]):
        init = max(init, multiple_of)
        if init > maximum or init % multiple_of:
            continue
        grid = Grid(init=init, maximum=maximum, multiple_of=multiple_of)
        for shape in (lambda b: float(b), lambda b: 1.0, lambda b: 100.0 - b):
            curve = {b: shape(b) for b in range(1, maximum + 1)}
            _pin(curve, grid, [grid.floor(maximum)])


def test_the_timing_phase_has_a_bounded_share_of_the_probe() -> None:
    assert timing_deadline(now=100.0, started=0.0, time_budget=None) == 150.0
    assert timing_deadline(now=1.0, started=0.0, time_budget=None) == 1.0 + MIN_TIMING_S
    assert timing_deadline(now=100.0, started=0.0, time_budget=120.0) == 120.0


def _timer(trials: list[Trial], curve: dict[int, float], timed: int = 2, warm: bool = True):  # noqa: ANN202
    """A ``run`` for ``time_warm`` that times sizes on a known rate curve (the rules, not the device)."""

    def run(size: int) -> Trial:
        step = size / curve[size]
        times = (step,) * timed if warm else ()
        trial = Trial(
            batch_size=size,
            fits=True,
            kind="time",
            steps=1 + timed,
            step_times_s=times,
            step_time_s=step if warm else None,
            samples_per_s=curve[size] if warm else None,
        )
        trials.append(trial)
        return trial

    return run


def test_time_warm_skips_a_size_its_verification_timed_and_pins_the_knee() -> None:
    grid = Grid(init=2, maximum=4096, multiple_of=1)
    curve = {b: 1000.0 * b / (b + 30) for b in range(1, 1001)}
    verified = 900 / curve[900]
    trials = [_trial(1000, (1.0,), steps=1), _trial(900, (verified, verified), steps=3, kind="verify")]
    notes = time_warm(
        trials, [1000, 900], grid, _timer(trials, curve), timed_steps=2, start_neighbourhood=lambda: lambda: False
    )
    timed = [t.batch_size for t in trials if t.kind == "time"]
    assert timed[0] == 1000 and 900 not in timed  # the verification's two warm steps count
    assert notes == []
    rates = warm_rates(trials)
    knee = min(b for b, r in rates.items() if r >= KNEE_FRACTION * max(rates.values()))
    lower = max(b for b in rates if b < knee)
    assert curve[lower] < KNEE_FRACTION * max(rates.values()) and knee <= KNEE_BRACKET * lower + 1


def test_time_warm_says_when_time_ran_out_and_names_the_knee() -> None:
    grid = Grid(init=2, maximum=4096, multiple_of=1)
    curve = {b: 1000.0 * b / (b + 30) for b in range(1, 1001)}
    trials: list[Trial] = []
    notes = time_warm(
        trials, [1000], grid, _timer(trials, curve), timed_steps=2, start_neighbourhood=lambda: lambda: True
    )
    assert [t.batch_size for t in trials] == [1000]
    assert notes == [
        "throughput: the knee is not pinned down below batch 1000: the time for timing sizes warm ran out "
        "(each size timed is one more trial)"
    ]


def test_time_warm_never_asks_twice_for_a_size_that_timed_no_warm_step() -> None:
    grid = Grid(init=2, maximum=4096, multiple_of=1)
    curve = {b: 1000.0 * b / (b + 30) for b in range(1, 1001)}
    trials: list[Trial] = [_trial(1000, (1.0, 1.0), steps=3, kind="time")]
    time_warm(
        trials, [], grid, _timer(trials, curve, warm=False), timed_steps=2, start_neighbourhood=lambda: lambda: False
    )
    asked = [t.batch_size for t in trials[1:]]
    assert len(asked) == len(set(asked)) == 1  # its trial timed nothing warm: not asked again


def _check_warm_alike(result: batchfit.Result, timed_steps: int) -> None:
    throughput = result.throughput
    assert throughput is not None and throughput.warm and throughput.timing_s is not None
    timed = [t for t in result.trials if t.kind == "time"]
    by_size = {t.batch_size: t for t in timed}
    # The largest and the safe batch are timed alike: one untimed step, then at least the same
    # timed ones (the safe batch's verification is such a trial when it times as many steps).
    for size in (result.max_batch, result.safe_batch):
        alike = [t for t in result.trials if t.batch_size == size and is_warm(t)]
        assert any(len(t.step_times_s) >= timed_steps for t in alike), size
        if size in by_size:
            assert by_size[size].steps == 1 + timed_steps and len(by_size[size].step_times_s) == timed_steps
    # The verification is the last trial of a new size: only the safe batch is timed after it, and
    # only when the verification timed fewer warm steps (a neighbourhood size timed before it may
    # be the safe batch itself).
    last_verify = max(i for i, t in enumerate(result.trials) if t.kind == "verify")
    verification = result.trials[last_verify]
    after = result.trials[last_verify + 1 :]
    assert all(t.kind == "time" and t.batch_size == result.safe_batch for t in after)
    before = [t for t in result.trials[:last_verify] if t.batch_size == result.safe_batch and is_warm(t)]
    timed_enough = any(len(t.step_times_s) >= timed_steps for t in [*before, verification])
    assert bool(after) == (not timed_enough)  # never timed again when as many warm steps were timed
    assert timed[0].batch_size == result.max_batch  # its search trial timed one cold step
    # Every rate compared comes from warm steps; no search trial's single cold step is among them.
    warm_sizes = {t.batch_size for t in result.trials if is_warm(t)}
    assert dict(throughput.rates).keys() == warm_sizes
    cold_only = {t.batch_size for t in result.search_trials if t.fits} - warm_sizes
    assert not cold_only & dict(throughput.rates).keys()
    assert throughput.knee_batch <= throughput.best_batch
    assert result.best_throughput_batch == throughput.best_batch
    # The knee's neighbourhood: a size below the knee was timed and is slower, unless none can be.
    below = [size for size in dict(throughput.rates) if size < throughput.knee_batch]
    if below:
        assert dict(throughput.rates)[max(below)] < KNEE_FRACTION * throughput.best_samples_per_s
    restored = batchfit.Result.from_json(result.to_json())
    assert restored.throughput == throughput


@pytest.mark.slow
def test_built_in_gpt_times_the_max_and_the_safe_batch_warm_alike() -> None:
    model, sample = examples.gpt()
    result = batchfit.find(model, sample, memory_limit="48MiB")
    _check_warm_alike(result, timed_steps=2)
    # Another headroom verifies another size; the sizes compared are still timed alike.
    other = batchfit.find(model, sample, memory_limit="48MiB", headroom=0.3, timed_steps=3)
    assert other.safe_batch < result.safe_batch
    _check_warm_alike(other, timed_steps=3)


def test_a_hugging_face_model_times_warm_alike() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (1, 64))
    result = batchfit.find(model, {"input_ids": ids, "labels": ids}, memory_limit="48MiB")
    _check_warm_alike(result, timed_steps=2)


def test_timed_steps_zero_times_nothing_more_and_still_ranks_warm_steps_only() -> None:
    model, sample = examples.gpt()
    result = batchfit.find(model, sample, memory_limit="48MiB", timed_steps=0)
    assert not any(t.kind == "time" for t in result.trials)
    assert result.throughput is not None and result.throughput.timing_s is None
    assert dict(result.throughput.rates).keys() == {t.batch_size for t in result.trials if is_warm(t)}


def test_a_size_above_the_largest_batch_is_never_the_best() -> None:
    """Seen on an H200 (GPT-2-small, bf16, 24 GiB): batch 22 fitted warm in the search with the
    optimizer state kept, failed from scratch, so the largest batch was 21; yet 22's warm search
    steps made it the "best throughput" batch, one no fresh run trains at."""
    largest = _trial(21, (0.097, 0.096), steps=3, kind="time")
    warm_above = _trial(22, (0.099,), steps=2)
    assert Throughput.of([largest, warm_above]).best_batch == 22  # without the bound: the defect
    bounded = Throughput.of([largest, warm_above], largest=21)
    assert bounded is not None and bounded.best_batch == 21 and dict(bounded.rates).keys() == {21}
