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
from batchfit.probe.timing import (
    KNEE_BRACKET,
    KNEE_STEP_DOWN,
    KNEE_STEPS,
    MIN_TIMING_S,
    SPREAD_BELOW,
    SPREAD_STEPS,
    knee_deadline,
    next_knee_size,
    step_at_max,
    time_knee,
    time_safe,
    trial_cost,
    unpinned_notes,
)
from batchfit.report import Throughput, Trial
from batchfit.report.throughput import KNEE_FRACTION, is_warm, knee_of, warm_rates
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


def _pin(
    curve: dict[int, float], grid: Grid, start: list[int], top: int, top_rate: float | None = None
) -> tuple[dict[int, float], list[int]]:
    """Run the knee's neighbourhood rule against a rate curve, as ``time_knee`` does."""
    rates = {size: curve[size] for size in start}
    asked: list[int] = []
    while (size := next_knee_size(rates, grid, top, top_rate)) is not None:
        assert size not in rates, "a size already timed is never asked again"
        assert size < top, "the largest batch is never timed again"
        asked.append(size)
        rates[size] = curve[size]
        assert len(asked) < 64
    return rates, asked


def _warm_trials(rates: dict[int, float]) -> list[Trial]:
    return [_trial(size, (size / rate,), steps=2, kind="time") for size, rate in rates.items()]


@pytest.mark.parametrize("saturation", [1, 3, 17, 40, 100, 300])
@pytest.mark.parametrize("multiple_of", [1, 8])
@pytest.mark.parametrize("start", ["cpu", "gpu"])
def test_the_knee_is_bracketed_on_any_saturating_curve(saturation: int, multiple_of: int, start: str) -> None:
    grid = Grid(init=multiple_of if multiple_of > 1 else 2, maximum=4096, multiple_of=multiple_of)
    top, safe = grid.floor(1000), grid.floor(900)
    curve = {b: 1000.0 * b / (b + saturation) for b in range(1, 4097)}  # rates that saturate
    # On a CPU only the first search trial (init_batch) runs a warm step, and the largest batch's
    # one cold step understates its rate; on a GPU every search trial runs a warm step.
    known = [grid.init] if start == "cpu" else [grid.init, grid.floor(60), grid.floor(500), top]
    rates, asked = _pin(curve, grid, known, top, top_rate=0.7 * curve[top] if start == "cpu" else None)
    assert len(asked) <= 2 * 12  # stepping down, then bisection: logarithmic in the sizes
    rates[safe] = curve[safe]  # the verification, last
    best = max(rates.values())
    knee = min(size for size, rate in rates.items() if rate >= KNEE_FRACTION * best)
    below = [size for size in rates if size < knee]
    note = unpinned_notes(_warm_trials(rates), top, safe, grid)
    if below:  # a slower size right below the knee, within the bracket, with no grid size between, or said
        lower = max(below)
        assert curve[lower] < KNEE_FRACTION * best
        pinned = knee <= KNEE_BRACKET * lower or grid.floor(int((lower * knee) ** 0.5)) <= lower
        assert pinned or note == [
            f"throughput: the safe batch's rate, timed last, moved the knee up to batch {knee}: it lies between "
            f"batch {lower} and {knee}"
        ]
        if saturation <= 10:  # a knee well below the safe batch is pinned before the verification
            assert pinned and note == []
    else:  # nothing smaller to time
        assert knee == grid.init or grid.floor(knee // KNEE_STEP_DOWN) in (knee, grid.init) and grid.init in rates


def test_the_rule_stops_on_any_small_grid() -> None:
    for init, maximum, multiple_of in itertools.product([1, 2, 3], [3, 5, 17], [1, 2]):
        init = max(init, multiple_of)
        if init > maximum or init % multiple_of:
            continue
        grid = Grid(init=init, maximum=maximum, multiple_of=multiple_of)
        for shape in (lambda b: float(b), lambda b: 1.0, lambda b: 100.0 - b):
            curve = {b: shape(b) for b in range(1, maximum + 1)}
            top = grid.floor(maximum)
            _pin(curve, grid, [top], top)
            _pin(curve, grid, [], top, top_rate=curve[top])


def test_the_knee_s_timing_costs_a_few_steps_at_the_largest_batch() -> None:
    assert knee_deadline(now=100.0, step_at_max_s=2.0, started=0.0, time_budget=None) == 100.0 + KNEE_STEPS * 2.0
    assert knee_deadline(now=1.0, step_at_max_s=0.01, started=0.0, time_budget=None) == 1.0 + MIN_TIMING_S
    assert knee_deadline(now=1.0, step_at_max_s=None, started=0.0, time_budget=None) == 1.0 + MIN_TIMING_S
    assert knee_deadline(now=100.0, step_at_max_s=50.0, started=0.0, time_budget=120.0) == 120.0
    # The step at the top of the curve: the slowest fitting trial at or below the largest batch.
    trials = [_trial(4, (0.1,), steps=2), _trial(200, (1.5,), steps=1), _trial(180, (1.2, 1.1), steps=3, kind="verify")]
    failed = Trial(batch_size=201, fits=False, kind="search", steps=0)
    assert step_at_max([*trials, failed, _trial(220, (9.0,), steps=2)], largest=200) == 1.5
    assert step_at_max([], largest=200) is None


def _timer(trials: list[Trial], curve: dict[int, float], warm: bool = True):  # noqa: ANN202
    """A ``run`` for the timing that times sizes on a known rate curve (the rules, not the device)."""

    def run(size: int, timed: int) -> Trial:
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


def test_time_knee_starts_below_the_largest_batch_and_pins_the_knee() -> None:
    grid = Grid(init=2, maximum=4096, multiple_of=1)
    curve = {b: 1000.0 * b / (b + 30) for b in range(1, 1001)}
    trials = [_trial(1000, (1000 / curve[1000] * 1.3,), steps=1)]  # the largest batch's one cold step
    notes = time_knee(trials, 1000, grid, _timer(trials, curve), timed_steps=1, out_of_time=lambda *_: False)
    timed = [t for t in trials if t.kind == "time"]
    assert notes == [] and timed[0].batch_size == 1000 // KNEE_STEP_DOWN
    assert all(t.batch_size < 1000 for t in timed)  # the largest batch is not timed again
    # The first size at or below an eighth of the largest is timed twice (the spread), every other
    # once: each after an untimed step.
    first_small = next(i for i, t in enumerate(timed) if t.batch_size <= 1000 // SPREAD_BELOW)
    assert [len(t.step_times_s) for t in timed] == [SPREAD_STEPS if i == first_small else 1 for i in range(len(timed))]
    rates = warm_rates(trials)
    knee = knee_of(rates)
    lower = max(b for b in rates if b < knee)
    assert curve[lower] < KNEE_FRACTION * max(rates.values()) and knee <= KNEE_BRACKET * lower + 1


def test_time_knee_starts_no_trial_that_would_end_past_its_time() -> None:
    # A curve still climbing at a quarter of the largest batch: the next sizes are above it. A trial
    # the deadline cannot hold (here: any above 400 samples) is not started, and the note says so.
    grid = Grid(init=2, maximum=4096, multiple_of=1)
    curve = {b: 1000.0 * b / (b + 600) for b in range(1, 1001)}
    trials = [_trial(1000, (1000 / curve[1000],), steps=1)]
    asked: list[tuple[int, int]] = []

    def out_of_time(size: int, steps: int) -> bool:
        asked.append((size, steps))
        return size > 400

    notes = time_knee(trials, 1000, grid, _timer(trials, curve), timed_steps=1, out_of_time=out_of_time)
    timed = [t.batch_size for t in trials if t.kind == "time"]
    assert timed == [250] and asked == [(250, 1), (500, 1)]  # 500, the middle of 250 and 1000, not run
    assert notes == [
        "throughput: the knee is not pinned down below batch 250: the time for timing sizes warm ran out "
        "(each size timed is one more trial)"
    ]


def test_the_knee_deadline_counts_a_trial_by_its_size() -> None:
    assert trial_cost(250, 2, 1000, step_at_max_s=1.2) == pytest.approx(0.6)
    assert trial_cost(250, 2, 1000, step_at_max_s=None) == 0.0  # nothing timed at the top: no estimate


def test_time_safe_times_a_safe_batch_its_verification_did_not() -> None:
    curve = {b: 1000.0 * b / (b + 30) for b in range(1, 1001)}
    trials = [_trial(1000, (1.0,), steps=1), _trial(900, (0.9,), steps=2, kind="verify")]  # one warm step
    assert time_safe(trials, 900, _timer(trials, curve), timed_steps=1) == [] and len(trials) == 2
    assert time_safe(trials, 900, _timer(trials, curve), timed_steps=2) == []  # two asked: timed again
    assert [(t.batch_size, t.kind, len(t.step_times_s)) for t in trials[2:]] == [(900, "time", 2)]


def test_time_knee_says_when_time_ran_out_and_names_the_knee() -> None:
    grid = Grid(init=2, maximum=4096, multiple_of=1)
    curve = {b: 1000.0 * b / (b + 30) for b in range(1, 1001)}
    trials: list[Trial] = [_trial(1000, (1.0, 1.0), steps=3, kind="time")]
    notes = time_knee(trials, 1000, grid, _timer(trials, curve), timed_steps=2, out_of_time=lambda *_: True)
    assert len(trials) == 1
    assert notes == [
        "throughput: the knee is not pinned down below batch 1000: the time for timing sizes warm ran out "
        "(each size timed is one more trial)"
    ]


def test_time_knee_never_asks_twice_for_a_size_that_timed_no_warm_step() -> None:
    grid = Grid(init=2, maximum=4096, multiple_of=1)
    curve = {b: 1000.0 * b / (b + 30) for b in range(1, 1001)}
    trials: list[Trial] = [_trial(1000, (1.0, 1.0), steps=3, kind="time")]
    time_knee(trials, 1000, grid, _timer(trials, curve, warm=False), timed_steps=2, out_of_time=lambda *_: False)
    asked = [t.batch_size for t in trials[1:]]
    assert len(asked) == len(set(asked)) == 1  # its trial timed nothing warm: not asked again


def test_a_knee_the_safe_batch_moves_up_is_said_to_be_unpinned() -> None:
    grid = Grid(init=2, maximum=4096, multiple_of=1)
    climbing = {250: 100.0, 500: 180.0, 900: 300.0}  # still climbing at the safe batch
    assert unpinned_notes(_warm_trials(climbing), 1000, 900, grid) == [
        "throughput: the safe batch's rate, timed last, moved the knee up to batch 900: it lies between "
        "batch 500 and 900"
    ]
    flat = {100: 280.0, 125: 290.0, 250: 296.0, 900: 300.0}
    assert unpinned_notes(_warm_trials(flat), 1000, 900, grid) == []
    not_moved = {100: 200.0, 250: 290.0, 900: 300.0}  # not pinned, but not by the safe batch: nothing to add
    assert unpinned_notes(_warm_trials(not_moved), 1000, 900, grid) == []


def _check_warm_alike(result: batchfit.Result, timed_steps: int) -> None:
    throughput = result.throughput
    assert throughput is not None and throughput.warm and throughput.timing_s is not None
    settings = result.settings
    # The knee's neighbourhood comes first, each size alike: one untimed step, then the timed ones
    # (the first size two while no size was timed twice: the spread needs two).
    timed = [t for t in result.trials if t.kind == "time"]
    first_timed = result.trials.index(timed[0]) if timed else len(result.trials)
    assert all(t.kind == "search" for t in result.trials[:first_timed])
    repeated = any(is_warm(t) and len(t.step_times_s) >= SPREAD_STEPS for t in result.trials[:first_timed])
    small = [i for i, t in enumerate(timed) if t.batch_size <= result.max_batch // SPREAD_BELOW]
    spread_at = None if repeated or not small else small[0]
    counts = [max(timed_steps, SPREAD_STEPS) if i == spread_at else timed_steps for i in range(len(timed))]
    assert [(t.steps, len(t.step_times_s)) for t in timed] == [(1 + c, c) for c in counts]
    assert (throughput.spread is not None) == (max(counts, default=0) >= 2 or repeated)
    # Then the safe batch's verification, last: `verify_steps` steps from a fresh optimizer under the
    # meter, then (the CPU's meter slows every step) `timed_steps` without it, the safe batch's rate.
    verification = result.trials[-1]
    assert verification.kind == "verify" and verification.batch_size == result.safe_batch and verification.fits
    assert verification.steps == settings.verify_steps + timed_steps
    assert len(verification.step_times_s) == timed_steps and is_warm(verification)
    assert result.max_batch not in {t.batch_size for t in timed}
    # Every rate compared comes from warm steps; no search trial's single cold step is among them.
    warm_sizes = {t.batch_size for t in result.trials if is_warm(t) and t.batch_size <= result.max_batch}
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
def test_built_in_gpt_times_the_safe_batch_and_the_knee_warm_alike() -> None:
    model, sample = examples.gpt()
    result = batchfit.find(model, sample, memory_limit="48MiB")
    _check_warm_alike(result, timed_steps=1)
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
    _check_warm_alike(result, timed_steps=1)


def test_timed_steps_zero_times_nothing_more_and_still_ranks_warm_steps_only() -> None:
    model, sample = examples.gpt()
    result = batchfit.find(model, sample, memory_limit="48MiB", timed_steps=0)
    assert not any(t.kind == "time" for t in result.trials)
    assert result.throughput is not None and result.throughput.timing_s is None
    assert dict(result.throughput.rates).keys() == {t.batch_size for t in result.trials if is_warm(t)}
    assert [t.steps for t in result.trials if t.kind == "verify"] == [result.settings.verify_steps]  # not extended


def test_a_size_above_the_largest_batch_is_never_the_best() -> None:
    """Seen on an H200 (GPT-2-small, bf16, 24 GiB): batch 22 fitted warm in the search with the
    optimizer state kept, failed from scratch, so the largest batch was 21; yet 22's warm search
    steps made it the "best throughput" batch, one no fresh run trains at."""
    largest = _trial(21, (0.097, 0.096), steps=3, kind="time")
    warm_above = _trial(22, (0.099,), steps=2)
    assert Throughput.of([largest, warm_above]).best_batch == 22  # without the bound: the defect
    bounded = Throughput.of([largest, warm_above], largest=21)
    assert bounded is not None and bounded.best_batch == 21 and dict(bounded.rates).keys() == {21}


class _SeesTheMeter(torch.nn.Module):
    """A model that records, at each forward, whether a dispatch mode (the CPU meter) watches it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.watched: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.watched.append(torch._C._len_torch_dispatch_stack() > 0)
        return self.linear(x)


def test_timed_steps_run_without_the_cpu_meter_after_the_steps_that_measure_memory() -> None:
    model = _SeesTheMeter()
    with batchfit.Prober(model, torch.randn(2, 8), memory_limit="64MiB", device="cpu") as prober:
        search = prober.trial(16, steps=3)
        watched_search, model.watched = model.watched, []
        timed = prober.trial(16, steps=3, kind="time")
        watched_timed, model.watched = model.watched, []
        again = prober.trial(16, steps=1)  # the optimizer state kept, as the timing trial's
        model.watched = []
        verified = prober.trial(16, steps=3, kind="verify", fresh_optimizer=True)  # verify_steps=2, then one timed
    assert verified.fits and model.watched == [True, True, False] and len(verified.step_times_s) == 1
    assert search.fits and watched_search == [True, True, True]
    assert watched_timed == [True, False, False]  # the untimed step metered, the timed ones plain
    assert timed.fits and len(timed.step_times_s) == 2
    assert timed.peak_bytes == again.peak_bytes  # its untimed step measured the memory
