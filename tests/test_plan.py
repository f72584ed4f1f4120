"""``batchfit.plan()`` (``batchfit.estimation.planning``): a target global batch as ranks x micro-batch x
accumulation steps.

The rule tests start from a real probe's result (a tiny MLP under a 2 MiB CPU limit) and swap in
hand-made trials, safe batches and rank counts with ``dataclasses.replace``, so every rule is pinned
on exact numbers while the result stays the real type a probe returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import batchfit
from batchfit.api import plan
from batchfit.estimation import Plan, plan_for
from batchfit.report import Result, Trial


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))


@pytest.fixture(scope="module")
def real() -> Result:
    torch.manual_seed(0)
    return batchfit.find(_model(), torch.randn(4, 64), memory_limit="2MiB", verify_steps=1)


def _trial(
    size: int, rate: float | None = None, *, timed_steps: int = 3, fits: bool = True, kind: str = "search"
) -> Trial:
    """A fitting trial at ``size``, timed at ``rate`` samples/s over ``timed_steps`` steps (untimed: None)."""
    step = size / rate if rate else None
    return Trial(
        batch_size=size,
        fits=fits,
        kind=kind,  # type: ignore[arg-type]
        samples_per_s=rate,
        step_time_s=step,
        step_times_s=(step,) * timed_steps if step is not None else (),
        steps=timed_steps + 1,
    )


def _result(
    real: Result, trials: tuple[Trial, ...] = (), safe: int = 100, world_size: int = 1, **settings: Any
) -> Result:
    return dataclasses.replace(
        real,
        trials=trials,
        safe_batch=safe,
        max_batch=safe + 10,
        world_size=world_size,
        settings=dataclasses.replace(real.settings, **settings) if settings else real.settings,
    )


def _consistent(p: Plan) -> None:
    assert p.global_batch == p.micro_batch * p.accumulation_steps * p.world_size
    assert p.exact and p.remainder == 0 and p.global_batch == p.target_batch
    assert p.micro_batch <= p.safe_batch


def test_real_result_splits_exactly_within_the_safe_batch(real: Result) -> None:
    assert real.safe_verified and real.world_size == 1
    target = 4 * real.max_batch + 4  # more than fits in one step
    p = plan_for(real, target)
    _consistent(p)
    assert p.accumulation_steps > 1
    assert target % p.micro_batch == 0
    assert p.safe_batch == real.safe_batch
    assert p.knee_batch == (real.throughput.knee_batch if real.throughput else None)


def test_untimed_takes_the_largest_divisor(real: Result) -> None:
    p = plan_for(_result(real, (_trial(8), _trial(64)), safe=100), 1024)
    _consistent(p)
    assert (p.micro_batch, p.accumulation_steps, p.global_batch) == (64, 16, 1024)
    assert p.samples_per_s is None
    assert "largest divisor" in p.reason and "none of its divisors was timed" in p.reason


def test_share_within_the_safe_batch_needs_no_accumulation(real: Result) -> None:
    p = plan_for(_result(real, safe=100), 96)
    assert (p.micro_batch, p.accumulation_steps) == (96, 1)
    assert "1 accumulation step (exact)" in str(p)


def test_fastest_measured_divisor_beats_a_larger_slower_one(real: Result) -> None:
    trials = (_trial(32, 10_000.0), _trial(64, 8_000.0))
    p = plan_for(_result(real, trials, safe=64), 256)
    _consistent(p)
    assert (p.micro_batch, p.accumulation_steps) == (32, 8)
    assert p.samples_per_s == 10_000.0
    assert "fastest measured divisor" in p.reason and "the larger 64 measured slower" in p.reason


def test_measured_plateau_beats_a_larger_untimed_divisor(real: Result) -> None:
    # 32 is the best rate measured anywhere, so an untimed 64 has no evidence to be faster.
    p = plan_for(_result(real, (_trial(32, 10_000.0), _trial(40, 9_800.0)), safe=100), 256)
    assert p.micro_batch == 32
    assert "were not timed" in p.reason and "plateau" in p.reason


def test_below_the_plateau_a_larger_untimed_divisor_wins(real: Result) -> None:
    # 8 is timed but far from the rate measured at 40 (which does not divide 256): bigger still paid.
    p = plan_for(_result(real, (_trial(8, 1_000.0), _trial(40, 10_000.0)), safe=100), 256)
    _consistent(p)
    assert (p.micro_batch, p.accumulation_steps) == (64, 4)
    assert p.samples_per_s is None
    assert "below the measured plateau" in p.reason


def test_below_the_plateau_skips_a_divisor_measured_slower(real: Result) -> None:
    trials = (_trial(8, 1_000.0), _trial(32, 800.0), _trial(40, 10_000.0))
    p = plan_for(_result(real, trials, safe=32), 256)
    assert p.micro_batch == 16  # untimed, larger than 8; 32 was measured slower than 8
    assert "not measured slower" in p.reason


def test_each_size_counts_its_best_timed_trial(real: Result) -> None:
    # 32's one-step search trial looks fastest, but its three-step verification is what counts.
    trials = (
        _trial(32, 20_000.0, timed_steps=1),
        _trial(32, 9_000.0, kind="verify"),
        _trial(16, 10_000.0),
    )
    p = plan_for(_result(real, trials, safe=32), 64)
    assert p.micro_batch == 16 and p.samples_per_s == 10_000.0


def test_failed_trials_carry_no_rate(real: Result) -> None:
    trials = (_trial(16, 10_000.0), _trial(32, 50_000.0, fits=False))
    p = plan_for(_result(real, trials, safe=32), 64)
    assert p.micro_batch == 16


def test_world_size_defaults_to_the_results(real: Result) -> None:
    p = plan_for(_result(real, safe=100, world_size=4), 1024)
    _consistent(p)
    assert (p.world_size, p.micro_batch, p.accumulation_steps) == (4, 64, 4)
    assert str(p).startswith("global batch 1024 = 4 ranks x micro-batch 64 x 4 accumulation steps (exact)")


def test_world_size_override_and_rates_from_another_group(real: Result) -> None:
    p = plan_for(_result(real, (_trial(25, 1_000.0),), safe=30, world_size=2), 1000, world_size=8)
    _consistent(p)
    assert (p.world_size, p.micro_batch, p.accumulation_steps) == (8, 25, 5)
    assert "measured with 2 rank(s), not 8" in p.reason


def test_target_must_divide_over_the_ranks(real: Result) -> None:
    with pytest.raises(ValueError, match=r"target_batch 1001 is not divisible by world_size 8.*1000 and 1008"):
        plan_for(_result(real), 1001, world_size=8)
    with pytest.raises(ValueError, match="not divisible by world_size 4"):
        plan_for(_result(real, world_size=4), 1022)


def test_prime_share_is_split_exactly_and_names_the_alternative(real: Result) -> None:
    p = plan_for(_result(real, safe=100), 101)
    _consistent(p)
    assert (p.micro_batch, p.accumulation_steps) == (1, 101)
    assert "micro-batch 100 x 1 accumulation step would give a global batch of 100, remainder 1" in p.reason


def test_twice_a_prime_over_ranks_names_the_alternatives_global_remainder(real: Result) -> None:
    p = plan_for(_result(real, safe=100), 2 * 2 * 101, world_size=2)  # 202 per rank: 1, 2, 101, 202
    _consistent(p)
    assert (p.micro_batch, p.accumulation_steps) == (2, 101)
    assert "micro-batch 100 x 2 accumulation steps would give a global batch of 400, remainder 4" in p.reason


def test_no_alternative_when_the_exact_split_is_good(real: Result) -> None:
    p = plan_for(_result(real, safe=100), 1024)
    assert "remainder" not in p.reason


def test_multiple_of_is_respected(real: Result) -> None:
    # 120's largest divisor within 100 is 60, but only 40, 24 and 8 are multiples of 8; a fast 60 is no candidate.
    p = plan_for(_result(real, (_trial(60, 99_000.0),), safe=100, multiple_of=8), 120)
    _consistent(p)
    assert (p.micro_batch, p.accumulation_steps) == (40, 3)
    assert "multiple" not in p.reason


def test_multiple_of_is_dropped_when_no_divisor_is_one(real: Result) -> None:
    p = plan_for(_result(real, safe=100, multiple_of=8), 105)
    _consistent(p)
    assert p.micro_batch == 35
    assert "multiple of 8, so it is ignored" in p.reason


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target_batch": 0}, ValueError, "target_batch must be positive"),
        ({"target_batch": -8}, ValueError, "target_batch must be positive"),
        ({"target_batch": 8.0}, TypeError, "target_batch must be an int"),
        ({"target_batch": True}, TypeError, "target_batch must be an int"),
        ({"target_batch": "8"}, TypeError, "target_batch must be an int"),
        ({"target_batch": 8, "world_size": 0}, ValueError, "world_size must be positive"),
        ({"target_batch": 8, "world_size": 2.0}, TypeError, "world_size must be an int"),
    ],
)
def test_bad_arguments(real: Result, kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        plan_for(real, **kwargs)
    with pytest.raises(error, match=match):
        plan(real, **kwargs)


def test_bad_first_arguments(real: Result) -> None:
    with pytest.raises(TypeError, match="result must be a batchfit Result, got dict"):
        plan_for({}, 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a batchfit Result or a torch.nn.Module to probe, got str"):
        plan("model", target_batch=8)
    with pytest.raises(TypeError, match="no probe to pass sample, memory_limit"):
        plan(real, torch.randn(4, 64), target_batch=8, memory_limit="2MiB")
    with pytest.raises(ValueError, match="safe_batch is 0"):
        plan_for(_result(real, safe=0), 8)


def test_plan_probes_a_model_end_to_end() -> None:
    torch.manual_seed(0)
    p = plan(_model(), torch.randn(4, 64), target_batch=1000, memory_limit="2MiB", verify_steps=1)
    _consistent(p)
    assert p.micro_batch * p.accumulation_steps == 1000
    assert p.accumulation_steps >= 2  # 1000 samples do not fit in 2 MiB at once


def test_plan_of_a_result_is_plan_for(real: Result) -> None:
    assert plan(real, target_batch=2048) == plan_for(real, 2048)


def test_str_mentions_the_numbers(real: Result) -> None:
    trials = (_trial(32, 12_345.0),)
    p = plan_for(_result(real, trials, safe=32, world_size=8), 1024)
    text = str(p)
    assert text.startswith("global batch 1024 = 8 ranks x micro-batch 32 x 4 accumulation steps (exact)")
    assert "12,345 samples/s measured at micro-batch 32" in text and "safe batch 32" in text
    assert p.reason in text


def test_knee_is_reported_beside(real: Result) -> None:
    assert real.throughput is not None
    p = plan_for(_result(real, safe=100), 64)
    assert p.knee_batch == real.throughput.knee_batch
    assert f"throughput knee {real.throughput.knee_batch}" in str(p)
    assert plan_for(dataclasses.replace(_result(real), throughput=None), 64).knee_batch is None


def test_plan_is_frozen_and_cannot_lie(real: Result) -> None:
    p = plan_for(_result(real), 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.micro_batch = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="is not micro_batch"):
        dataclasses.replace(p, micro_batch=p.micro_batch + 1)
    with pytest.raises(ValueError, match="do not match"):
        dataclasses.replace(p, target_batch=p.target_batch + 1)
    short = dataclasses.replace(p, target_batch=p.global_batch + 3, exact=False, remainder=3)
    assert "(3 short of the target" in str(short)
