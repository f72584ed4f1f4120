"""``Result.recommend()`` / ``batchfit.recommend()``: the batch to train with, the bound that decided it, and why.

The rule tests start from a real probe's result (a tiny MLP under a CPU memory limit) and swap in
hand-made safe batches, throughput rates, noise scales and rank counts with ``dataclasses.replace``,
so every rule is pinned on exact numbers (no timing is compared) while the result stays the real
type a probe returns. The split arithmetic is checked exhaustively against a brute force.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from typing import Any

import pytest
import torch

import batchfit
from batchfit.report import NoiseScale, Recommendation, Result, Throughput, Trial, recommend
from batchfit.report.global_split import split_global
from batchfit.report.recommendation_rules import DECIDERS
from batchfit.report.throughput import KNEE_FRACTION


@pytest.fixture(scope="module")
def real() -> Result:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return batchfit.find(model, torch.randn(4, 64), memory_limit="2MiB", verify_steps=1)


def _speed(rates: dict[int, float]) -> Throughput:
    """The throughput answer of these rates, as ``Throughput.of`` would compute it."""
    best = max(rates, key=lambda size: rates[size])
    knee = min(size for size, rate in rates.items() if rate >= KNEE_FRACTION * rates[best])
    return Throughput(
        best_batch=best,
        best_samples_per_s=rates[best],
        knee_batch=knee,
        knee_samples_per_s=rates[knee],
        spread=0.01,
        warm=True,
        rates=tuple(sorted(rates.items())),
    )


def _noise(b: float | None, low: float, high: float | None, passes: int = 128) -> NoiseScale:
    return NoiseScale(
        b_simple=b,
        low=low,
        high=high,
        gradient_sq=1.0,
        trace_sigma=1.0,
        small_batch=4,
        big_batch=32,
        windows=4,
        passes=passes,
        samples=512,
        elapsed_s=1.0,
    )


def _result(
    real: Result,
    safe: int,
    rates: dict[int, float] | None = None,
    noise: NoiseScale | None = None,
    world_size: int = 1,
    **settings: Any,
) -> Result:
    throughput = _speed(rates) if rates else None
    return dataclasses.replace(
        real,
        trials=_timed(rates or {}),  # what a target's split is chosen on: the same rates, no real timing
        safe_batch=safe,
        max_batch=max([safe + 8, *(rates or {})]),
        best_throughput_batch=throughput.best_batch if throughput else safe,
        throughput=throughput,
        noise_scale=noise,
        world_size=world_size,
        safe_verified=True,
        settings=dataclasses.replace(real.settings, **settings) if settings else real.settings,
    )


def _timed(rates: dict[int, float]) -> tuple[Trial, ...]:
    """A fitting trial timed at each rate, three warm steps."""
    return tuple(
        Trial(size, True, "search", samples_per_s=rate, step_time_s=t, step_times_s=(t,) * 3, steps=4)
        for size, rate in sorted(rates.items())
        for t in (size / rate,)
    )


def _consistent(rec: Recommendation, result: Result) -> None:
    assert rec.batch_size <= result.safe_batch
    assert rec.global_batch == rec.batch_size * rec.accumulation * rec.world_size
    assert rec.world_size == result.world_size
    assert rec.decided_by in DECIDERS
    assert rec.decision().startswith(f"train at {rec.batch_size}") and rec.decision().endswith(rec.decided_by)
    assert rec.reason and not rec.reason.startswith("train at ")  # the why, apart from the decision
    assert Recommendation.from_dict(json.loads(json.dumps(dataclasses.asdict(rec)))) == rec
    assert Recommendation.from_json(rec.to_json()) == rec


# A real probe -------------------------------------------------------------------------------------
def test_a_real_result_recommends_within_the_safe_batch(real: Result) -> None:
    rec = real.recommendation
    _consistent(rec, real)
    assert rec == recommend(real) == batchfit.recommend(real) == real.recommend()
    assert rec.max_batch == real.max_batch and rec.safe_batch == real.safe_batch
    assert rec.noise_scale is None and rec.target is None and rec.target_changed_by is None
    assert any("noise_scale=True" in c and "--noise-scale" in c for c in rec.caveats)
    assert rec.lines()[:2] == [f"recommended      {rec.decision()}", f"why              {rec.reason}"]
    assert str(rec) == "\n".join(rec.lines())


def test_the_decision_and_its_reasons_are_lines_of_their_own(real: Result) -> None:
    rec = _result(real, 48, {16: 500.0, 48: 1000.0}, _noise(190.0, 150.0, 240.0)).recommendation
    assert rec.lines()[:2] == [
        "recommended      train at 48 x 4 accumulation (global batch 192), decided by the noise scale",
        "why              the noise scale (~190, 90% 150-240 samples) is above the 48 that fits, so accumulate; "
        "beyond ~240 the extra samples buy little",
    ]
    plain = _result(real, 40).recommendation
    assert plain.decision() == "train at 40, decided by memory"


def test_the_result_document_carries_the_recommendation_and_reads_back(real: Result) -> None:
    noisy = _result(real, 48, {16: 500.0, 48: 1000.0}, _noise(190.0, 150.0, 240.0))
    data = json.loads(noisy.to_json())
    assert data["recommendation"] == json.loads(json.dumps(dataclasses.asdict(noisy.recommendation)))
    assert Recommendation.from_dict(data["recommendation"]) == noisy.recommendation
    back = Result.from_json(noisy.to_json())
    assert back == noisy and back.recommendation == noisy.recommendation


def test_metrics_log_what_was_measured_and_nothing_else(real: Result) -> None:
    noisy = _result(real, 48, {16: 500.0, 48: 1000.0}, _noise(None, 150.0, None)).recommendation
    assert noisy.metrics() == {
        "batchfit/noise_scale_low": 150.0,
        "batchfit/recommended_batch": float(noisy.batch_size),
        "batchfit/recommended_global_batch": float(noisy.global_batch),
    }
    measured = _result(real, 48, {16: 500.0, 48: 1000.0}, _noise(30.0, 20.0, 40.0)).recommendation.metrics()
    noise = ("batchfit/noise_scale", "batchfit/noise_scale_low", "batchfit/noise_scale_high")
    assert [measured[name] for name in noise] == [30.0, 20.0, 40.0]
    assert len(measured) == 5


# Rule 3 and 4: no noise scale -------------------------------------------------------------------
def test_without_a_noise_scale_the_knee_says_how_much_faster_the_safe_batch_is(real: Result) -> None:
    result = _result(real, 96, {16: 400.0, 32: 800.0, 64: 1000.0, 96: 1020.0})
    rec = result.recommendation
    _consistent(rec, result)
    assert (rec.batch_size, rec.accumulation, rec.decided_by) == (64, 1, "throughput knee")
    assert rec.reason == (
        "the throughput knee, the smallest batch within 5% of the best rate; 96 fits but is only 2% faster per sample"
    )
    assert rec.knee_batch == 64 and rec.best_batch == 96 and rec.samples_per_s == 1000.0


@pytest.mark.parametrize(("safe_rate", "says"), [(1003.0, "no faster per sample"), (990.0, "1% slower per sample")])
def test_a_gain_that_rounds_to_nothing_reads_as_none(real: Result, safe_rate: float, says: str) -> None:
    rec = _result(real, 96, {16: 400.0, 64: 1000.0, 96: safe_rate}).recommendation
    assert rec.batch_size == 64 and rec.reason.endswith(f"96 fits but is {says}")


def test_a_knee_at_or_above_the_safe_batch_leaves_memory_to_decide(real: Result) -> None:
    for knee in (48, 64):
        result = _result(real, 48, {16: 300.0, knee: 1000.0})
        rec = result.recommendation
        _consistent(rec, result)
        assert (rec.batch_size, rec.decided_by) == (48, "memory")
        assert "the safe batch 48" in rec.reason and "throughput knee" in rec.reason


def test_nothing_timed_gives_the_safe_batch(real: Result) -> None:
    result = _result(real, 40)
    rec = result.recommendation
    assert (rec.batch_size, rec.accumulation, rec.decided_by) == (40, 1, "memory")
    assert "no step was timed" in rec.reason and rec.knee_batch is None and rec.samples_per_s is None


def test_an_estimate_recommends_its_safe_batch() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    estimate = batchfit.estimate(model, torch.randn(4, 64), memory_limit="2MiB", device="cpu")
    rec = estimate.recommendation
    _consistent(rec, estimate)
    assert (rec.batch_size, rec.decided_by) == (estimate.safe_batch, "memory")
    assert "estimated" in rec.reason and "the estimate timed no step" in rec.reason


# Rule 2: the noise scale --------------------------------------------------------------------------
def test_a_noise_scale_above_what_fits_accumulates_to_it(real: Result) -> None:
    result = _result(real, 48, {16: 500.0, 48: 1000.0}, _noise(190.0, 150.0, 240.0))
    rec = result.recommendation
    _consistent(rec, result)
    assert (rec.batch_size, rec.accumulation, rec.global_batch, rec.decided_by) == (48, 4, 192, "noise scale")
    assert rec.reason == (
        "the noise scale (~190, 90% 150-240 samples) is above the 48 that fits, so accumulate; beyond ~240 the extra "
        "samples buy little"
    )
    assert (rec.noise_scale, rec.noise_low, rec.noise_high) == (190.0, 150.0, 240.0)
    assert any("SGD" in c and "Adam" in c for c in rec.caveats)
    assert any("initialisation" in c and "again later" in c for c in rec.caveats)
    assert not any("interval is wide" in c for c in rec.caveats)  # 240 / 150 < 2


def test_a_noise_scale_just_above_what_fits_does_not_double_the_batch(real: Result) -> None:
    rec = _result(real, 48, {48: 1000.0}, _noise(60.0, 50.0, 70.0)).recommendation
    assert (rec.batch_size, rec.accumulation, rec.decided_by) == (48, 1, "noise scale")
    assert "just above the 48 that fits" in rec.reason


def test_a_noise_scale_below_the_knee_trains_at_the_knee(real: Result) -> None:
    result = _result(real, 96, {16: 400.0, 64: 1000.0, 96: 1020.0}, _noise(40.0, 30.0, 55.0))
    rec = result.recommendation
    _consistent(rec, result)
    assert (rec.batch_size, rec.accumulation, rec.decided_by) == (64, 1, "throughput knee")
    assert rec.reason.startswith("the throughput knee; 96 fits but is only 2% faster per sample")
    assert "noise scale (~40, 90% 30-55 samples) is below it" in rec.reason
    assert "below the knee the device idles" in rec.reason


def test_a_noise_scale_below_a_knee_that_does_not_fit_trains_at_the_safe_batch(real: Result) -> None:
    rec = _result(real, 48, {16: 400.0, 64: 1000.0}, _noise(20.0, 15.0, 25.0)).recommendation
    assert (rec.batch_size, rec.decided_by) == (48, "memory")
    assert "the throughput knee 64 is above it" in rec.reason


def test_a_noise_scale_between_knee_and_safe_is_rounded_to_the_grid(real: Result) -> None:
    result = _result(real, 144, {32: 500.0, 64: 1000.0, 144: 1010.0}, _noise(100.0, 80.0, 130.0), multiple_of=8)
    rec = result.recommendation
    _consistent(rec, result)
    assert (rec.batch_size, rec.accumulation, rec.decided_by) == (104, 1, "noise scale")  # 100 / 8 = 12.5 -> 13
    assert "between the throughput knee 64 and the 144 that fits" in rec.reason
    plain = _result(real, 144, {32: 500.0, 64: 1000.0, 144: 1010.0}, _noise(100.0, 80.0, 130.0)).recommendation
    assert plain.batch_size == 100


def test_without_timing_a_noise_scale_within_what_fits_is_taken_as_it_is(real: Result) -> None:
    rec = _result(real, 48, None, _noise(30.4, 25.0, 40.0)).recommendation
    assert (rec.batch_size, rec.decided_by) == (30, "noise scale")


def test_a_drowned_signal_counts_as_a_large_noise_scale(real: Result) -> None:
    above = _result(real, 48, {48: 1000.0}, _noise(None, 150.0, None)).recommendation
    assert (above.batch_size, above.accumulation, above.decided_by) == (48, 4, "noise scale")  # ceil(150 / 48)
    assert "noise scale is large" in above.reason and "at least ~150" in above.reason
    within = _result(real, 48, {48: 1000.0}, _noise(None, 20.0, None)).recommendation
    assert (within.batch_size, within.accumulation, within.decided_by) == (48, 1, "memory")
    assert "a larger batch still buys fewer steps" in within.reason
    assert within.noise_scale is None and within.noise_low == 20.0
    assert any("interval is wide" in c and "--noise-passes 256" in c for c in within.caveats)


def test_a_wide_interval_asks_for_more_passes(real: Result) -> None:
    rec = _result(real, 48, {48: 1000.0}, _noise(100.0, 40.0, 300.0, passes=64)).recommendation
    assert any("interval is wide (90% 40-300)" in c and "noise_passes=128" in c for c in rec.caveats)


def test_ranks_compare_the_global_noise_scale_with_every_ranks_batch(real: Result) -> None:
    result = _result(real, 48, {48: 1000.0}, _noise(190.0, 150.0, 240.0), world_size=2)
    rec = result.recommendation
    _consistent(rec, result)
    assert (rec.batch_size, rec.accumulation, rec.world_size, rec.global_batch) == (48, 2, 2, 192)
    assert rec.decision().startswith("train at 48 per rank x 2 accumulation x 2 ranks (global batch 192)")
    assert "above the 96 that fits over 2 ranks" in rec.reason
    assert "x 2 ranks" in rec.lines()[0]


# Rule 1: a target ---------------------------------------------------------------------------------
def test_a_target_is_reached_exactly_with_the_largest_micro_batch(real: Result) -> None:
    result = _result(real, 48, {48: 1000.0}, _noise(190.0, 150.0, 240.0), world_size=4)
    rec = result.recommend(target_batch=1024)
    _consistent(rec, result)
    assert (rec.batch_size, rec.accumulation, rec.global_batch, rec.decided_by) == (32, 8, 1024, "target")
    assert rec.target == 1024 and rec.target_changed_by == 0 and rec.exact
    assert rec.reason.startswith("the target global batch 1024, exactly: micro-batch 32 is the largest divisor")
    assert any("above the noise scale" in c for c in rec.caveats)


def test_a_target_that_cannot_be_reached_says_by_how_much(real: Result) -> None:
    result = _result(real, 48, {48: 1000.0}, multiple_of=8, world_size=3)
    rec = result.recommend(target_batch=100)  # 3 ranks cannot share 100
    _consistent(rec, result)
    assert (rec.batch_size, rec.accumulation, rec.global_batch, rec.target_changed_by) == (32, 1, 96, -4)
    assert not rec.exact and rec.remainder == 4
    assert "the target global batch 100 becomes 96, 4 short of it" in rec.reason
    assert "multiples of 8" in rec.reason
    short = _result(real, 48, {48: 1000.0}, world_size=3).recommend(target_batch=100)
    assert short.global_batch == 99 and short.target_changed_by == -1
    assert "1 short of it" in short.reason and "over 3 ranks" in short.reason


def test_a_multiple_no_divisor_meets_is_dropped_for_an_exact_split(real: Result) -> None:
    result = _result(real, 48, {48: 1000.0}, multiple_of=8)
    rec = result.recommend(target_batch=330)  # 330's divisors within 48: none is a multiple of 8
    _consistent(rec, result)
    assert (rec.batch_size, rec.accumulation, rec.global_batch, rec.target_changed_by) == (33, 10, 330, 0)
    assert "no divisor of 330 within the safe batch is a multiple of 8, so it is ignored" in rec.reason


def test_a_poor_exact_split_names_the_faster_one_beside(real: Result) -> None:
    rec = _result(real, 144, {144: 1000.0}).recommend(target_batch=997)  # a prime
    assert (rec.batch_size, rec.accumulation, rec.target_changed_by) == (1, 997, 0)
    assert "micro-batch 144 x 6 accumulation steps would give a global batch of 864, remainder 133" in rec.reason


def test_target_tokens_in_whole_sequences(real: Result) -> None:
    result = _result(real, 48, {48: 1000.0})
    rec = result.recommend(target_tokens=100_000, seq_len=1024)  # 97.7 sequences -> 98
    _consistent(rec, result)
    assert rec.target == 98 and rec.seq_len == 1024 and rec.target_tokens == 100_000
    assert rec.global_batch == 98 and rec.tokens_per_step == 98 * 1024
    assert rec.reason.startswith(
        "target_tokens 100,000 is not a whole number of 1,024-token sequences: rounded up to 98 sequences, "
        "100,352 tokens per step (352 more; the nearest below is 97 sequences, 99,328 tokens)"
    )
    assert "(global batch 98, 100,352 tokens)" in rec.lines()[0]
    view = result.recommend(seq_len=512)
    assert view.tokens_per_step == view.global_batch * 512 and view.target is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target_batch": 8, "target_tokens": 800, "seq_len": 100}, TypeError, "not both"),
        ({"target_batch": 0}, ValueError, "target_batch must be positive"),
        ({"target_batch": 8.0}, TypeError, "target_batch must be an int"),
        ({"target_batch": True}, TypeError, "target_batch must be an int"),
        ({"target_tokens": 800}, ValueError, "needs seq_len="),
        ({"target_tokens": 800, "seq_len": -1}, ValueError, "seq_len must be positive"),
    ],
)
def test_bad_arguments(real: Result, kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        recommend(real, **kwargs)
    with pytest.raises(TypeError, match="must be a batchfit Result"):
        recommend("result")  # type: ignore[arg-type]


# The split, exhaustively ----------------------------------------------------------------------------
def test_split_global_is_exact_whenever_a_split_is_and_nearest_otherwise() -> None:
    for target, safe, ranks, multiple in itertools.product(range(1, 97), range(1, 25), (1, 2, 3), (1, 2, 3, 8)):
        micro, steps = split_global(target, safe, ranks, multiple)
        step = multiple if multiple <= safe else 1
        grid = range(step, safe // step * step + 1, step)
        assert 1 <= micro <= safe and steps >= 1
        if target % ranks == 0:  # exact, on the grid where a divisor is on it, else off it
            divisors = [m for m in range(1, safe + 1) if target // ranks % m == 0]
            on_grid = [m for m in divisors if m % multiple == 0]
            assert micro == max(on_grid or divisors) and micro * steps * ranks == target
            continue
        assert micro in grid
        top = max(grid)
        assert steps == max(1, -(-target // (top * ranks)))  # the fewest accumulation steps
        nearest = min(abs(m * steps * ranks - target) for m in grid)
        assert abs(micro * steps * ranks - target) == nearest


def test_no_rule_goes_above_the_safe_batch_or_off_the_grid(real: Result) -> None:
    noises = [
        None,
        _noise(3.0, 2.0, 5.0),
        _noise(70.0, 40.0, 90.0),
        _noise(900.0, 500.0, None),
        _noise(None, 9.0, None),
    ]
    speeds: list[dict[int, float] | None] = [None, {8: 100.0, 16: 900.0, 40: 1000.0}, {8: 100.0, 128: 1000.0}]
    for safe, noise, rates, ranks, multiple, target in itertools.product(
        (5, 24, 40), noises, speeds, (1, 3), (1, 4, 8), (None, 7, 96, 1000)
    ):
        result = _result(real, safe, rates, noise, world_size=ranks, multiple_of=multiple)
        rec = result.recommend(target_batch=target)
        _consistent(rec, result)
        if multiple > safe:
            assert any("multiple_of" in c for c in rec.caveats)
        elif rec.batch_size % multiple:  # only an exact split no multiple divides leaves the grid, and says so
            assert target is not None and rec.exact and f"multiple of {multiple}, so it is ignored" in rec.reason
        if target is not None:
            assert rec.target_changed_by == rec.global_batch - target and rec.decided_by == "target"


# The record ---------------------------------------------------------------------------------------
def test_a_recommendation_cannot_lie(real: Result) -> None:
    rec = _result(real, 48, {48: 1000.0}).recommend(target_batch=96)
    with pytest.raises(ValueError, match="is not batch_size"):
        dataclasses.replace(rec, global_batch=97)
    with pytest.raises(ValueError, match="target_changed_by"):
        dataclasses.replace(rec, target_changed_by=1)
    with pytest.raises(ValueError, match="tokens_per_step"):
        dataclasses.replace(rec, seq_len=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.batch_size = 1  # type: ignore[misc]
    data = dataclasses.asdict(rec)
    for change, match in (
        ({"batch_size": 0}, r"batch_size' must be an int in \[1, "),
        ({"batch_size": 60, "global_batch": 120, "target_changed_by": 24}, "batch_size' must not exceed 'safe_batch'"),
        ({"decided_by": "luck"}, "decided_by' must be one of"),
        ({"global_batch": 95}, "not a batchfit recommendation: global_batch 95"),
        ({"extra": 1}, "unknown field 'extra'"),
    ):
        with pytest.raises(ValueError, match=match):
            Recommendation.from_dict({**data, **change})


def test_recommending_from_a_document_needs_no_torch(real: Result, tmp_path: Any) -> None:
    path = tmp_path / "result.json"
    path.write_text(_result(real, 48, {48: 1000.0}, _noise(190.0, 150.0, 240.0)).to_json())
    code = (
        "import sys, batchfit; r = batchfit.Result.from_json(open(sys.argv[1]).read()); "
        "print(r.recommendation.global_batch, batchfit.recommend(r, target_batch=100).global_batch, "
        "'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["192", "100", "False"]


def test_a_target_takes_the_fastest_measured_divisor_on_the_plateau_as_plan_does(real: Result) -> None:
    # A knee below the safe batch: 10 runs at the best rate, 20 and 40 slower (the GPT's shape at 64 MiB).
    result = _result(real, 40, {10: 1000.0, 20: 700.0, 40: 600.0})
    rec = result.recommend(target_batch=40)
    _consistent(rec, result)
    assert (rec.batch_size, rec.accumulation) == (10, 4)  # the largest divisor (40 x 1) ran slower
    assert rec.samples_per_s == 1000.0 and "fastest measured divisor" in rec.reason
    assert rec == batchfit.plan(result, target_batch=40)
