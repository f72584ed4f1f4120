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
from batchfit.report import Recommendation, Result, Trial


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
    assert "1 accumulation step (exact)" in p.summary()


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
    assert p.summary().startswith("global batch 1024 = 4 ranks x micro-batch 64 x 4 accumulation steps (exact)")


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
    with pytest.raises(TypeError, match="result must be a batchfit Result or Frontier, got dict"):
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
    text = p.summary()
    assert text.startswith("global batch 1024 = 8 ranks x micro-batch 32 x 4 accumulation steps (exact)")
    assert "12,345 samples/s measured at micro-batch 32" in text and "safe batch 32" in text
    assert p.reason in text


def test_knee_is_reported_beside(real: Result) -> None:
    assert real.throughput is not None
    p = plan_for(_result(real, safe=100), 64)
    assert p.knee_batch == real.throughput.knee_batch
    assert f"throughput knee {real.throughput.knee_batch}" in p.summary()
    assert plan_for(dataclasses.replace(_result(real), throughput=None), 64).knee_batch is None


def test_plan_is_frozen_and_cannot_lie(real: Result) -> None:
    p = plan_for(_result(real), 64)
    assert isinstance(p, Plan) and isinstance(p, Recommendation)  # a plan is a recommendation decided by the target
    assert (p.micro_batch, p.accumulation_steps, p.target_batch) == (p.batch_size, p.accumulation, p.target)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.batch_size = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="is not batch_size"):
        dataclasses.replace(p, batch_size=p.micro_batch + 1)
    with pytest.raises(ValueError, match="target_changed_by"):
        dataclasses.replace(p, target=p.global_batch + 1)
    short = dataclasses.replace(p, target=p.global_batch + 3, target_changed_by=-3)
    assert not short.exact and short.remainder == 3
    assert "(3 short of the target" in short.summary()


def test_a_plan_round_trips_through_json(real: Result) -> None:
    p = plan_for(_result(real, (_trial(32, 10_000.0),), safe=64), 256, seq_len=128)
    assert Recommendation.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match="not a batchfit recommendation"):
        Recommendation.from_json(p.to_json().replace('"batch_size": 32', '"batch_size": 31'))


# A global batch in tokens (issue 21) ---------------------------------------------------------------
SEQ = 16  # the length the small language model below is probed at


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 32)
        self.head = torch.nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids)).float().logsumexp(-1).mean()


@pytest.fixture(scope="module")
def lm() -> Result:
    """A real probe of a small language model on batches of ``SEQ``-token sequences."""
    torch.manual_seed(0)
    return batchfit.find(
        _TinyLM(), make_batch=lambda b: torch.randint(0, 50, (b, SEQ)), memory_limit="2MiB", verify_steps=1
    )


def _records_length() -> bool:
    return "sized_on" in getattr(Result, "__dataclass_fields__", {})


def test_tokens_to_batch_rounds_up_to_whole_sequences_per_rank() -> None:
    from batchfit.estimation.planning import tokens_to_batch

    assert tokens_to_batch(524_288, 2048, 8) == 256
    assert tokens_to_batch(3 * 2048, 2048) == 3
    assert tokens_to_batch(3 * 2048 + 1, 2048) == 4
    assert tokens_to_batch(500_000, 2048, 8) == 248  # 245 sequences, then a multiple of the 8 ranks
    with pytest.raises(ValueError, match="less than one sequence of seq_len 2,048 on each of 8 ranks"):
        tokens_to_batch(8 * 2048 - 1, 2048, 8)


def test_tokens_split_into_micro_batch_length_accumulation_and_ranks(real: Result) -> None:
    p = plan_for(_result(real, safe=8, world_size=8), target_tokens=524_288, seq_len=2048)
    _consistent(p)
    assert (p.target_batch, p.micro_batch, p.accumulation_steps, p.world_size) == (256, 8, 4, 8)
    assert (p.seq_len, p.tokens_per_step, p.target_tokens) == (2048, 524_288, 524_288)
    assert p.summary().startswith(
        "524,288 tokens/step = global batch 256 x 2,048 tokens = 8 ranks x micro-batch 8 x 4 accumulation steps (exact)"
    )
    assert "rounded" not in p.reason
    assert plan(_result(real, safe=8, world_size=8), target_tokens=524_288, seq_len=2048) == p


def test_tokens_not_a_whole_number_of_sequences_round_up_and_say_so(real: Result) -> None:
    p = plan_for(_result(real, safe=100), target_tokens=500_000, seq_len=2048, world_size=8)
    _consistent(p)
    assert (p.target_batch, p.micro_batch, p.accumulation_steps) == (248, 31, 1)
    assert (p.tokens_per_step, p.target_tokens) == (507_904, 500_000)
    assert "(7,904 tokens over the target 500,000: whole sequences)" in p.summary()
    assert p.reason.startswith(
        "target_tokens 500,000 is not a whole number of 2,048-token sequences for each of 8 ranks: rounded up to "
        "248 sequences, 507,904 tokens per step (7,904 more; the nearest below is 240 sequences, 491,520 tokens)"
    )


def test_a_sample_target_with_seq_len_shows_the_token_view(real: Result) -> None:
    trials = (_trial(32, 1_000.0),)
    p = plan_for(_result(real, trials, safe=32), 64, seq_len=512)
    assert (p.tokens_per_step, p.target_tokens) == (64 * 512, None)
    assert p.summary().startswith("32,768 tokens/step = global batch 64 x 512 tokens = micro-batch 32 x 2")
    assert "1,000 samples/s (512,000 tokens/s) measured at micro-batch 32" in p.summary()
    assert plan_for(real, 64).seq_len is None and "tokens" not in plan_for(real, 64).summary()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target_batch": 8, "target_tokens": 4096, "seq_len": 16}, TypeError, "exactly one of.*both were given"),
        ({}, TypeError, "exactly one of target_batch .* and target_tokens .*neither was given"),
        ({"seq_len": 16}, TypeError, "neither was given"),
        ({"target_tokens": 0, "seq_len": 16}, ValueError, "target_tokens must be positive"),
        ({"target_tokens": 4096.0, "seq_len": 16}, TypeError, "target_tokens must be an int"),
        ({"target_tokens": 4096, "seq_len": 0}, ValueError, "seq_len must be positive"),
        ({"target_tokens": 4096, "seq_len": "16"}, TypeError, "seq_len must be an int"),
        ({"target_tokens": 4096, "seq_len": True}, TypeError, "seq_len must be an int"),
        ({"target_tokens": 1000, "seq_len": 2048}, ValueError, "target_tokens 1,000 is less than one sequence of "
         "seq_len 2,048: a step holds whole sequences"),
        ({"target_tokens": 4096, "seq_len": 1024, "world_size": 8}, ValueError, r"each of 8 ranks \(8,192 tokens\)"),
        ({"target_tokens": 4096}, ValueError, "target_tokens 4,096 needs seq_len="),
    ],
)  # fmt: skip
def test_bad_token_arguments(real: Result, kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        plan_for(real, **kwargs)
    with pytest.raises(error, match=match):
        plan(real, **kwargs)


def test_tokens_refused_before_the_probe() -> None:
    trials: list[Any] = []
    with pytest.raises(ValueError, match="less than one sequence"):
        plan(_TinyLM(), torch.randint(0, 50, (2, SEQ)), target_tokens=8, seq_len=SEQ, callback=trials.append)
    with pytest.raises(ValueError, match="needs seq_len="):  # a plain sample records no length
        plan(_TinyLM(), torch.randint(0, 50, (2, SEQ)), target_tokens=4096, callback=trials.append)
    assert trials == []


def test_plan_cannot_lie_about_tokens(real: Result) -> None:
    p = plan_for(_result(real), target_tokens=64 * 128, seq_len=128)
    with pytest.raises(ValueError, match=r"tokens_per_step 8193 is not global_batch x seq_len \(8192\)"):
        dataclasses.replace(p, tokens_per_step=p.tokens_per_step + 1)  # type: ignore[operator]
    with pytest.raises(ValueError, match="tokens_per_step"):
        dataclasses.replace(p, seq_len=None)


def test_tokens_from_a_real_probe_at_a_known_length(lm: Result) -> None:
    assert lm.safe_verified and lm.safe_batch >= 8
    target = 4 * lm.max_batch * SEQ + 3  # more than one step holds, and not a whole number of sequences
    p = plan(lm, target_tokens=target, seq_len=SEQ)
    assert p.target_batch == -(-target // SEQ) and p.global_batch == p.target_batch
    assert p.micro_batch * p.accumulation_steps * SEQ == p.tokens_per_step >= target
    assert p.accumulation_steps > 1 and p.micro_batch <= lm.safe_batch
    assert p.tokens_per_step - target < SEQ and "rounded up" in p.reason
    in_samples = plan_for(lm, p.target_batch, seq_len=SEQ)  # the same split, asked in sequences
    assert (in_samples.micro_batch, in_samples.accumulation_steps, in_samples.tokens_per_step) == (
        p.micro_batch,
        p.accumulation_steps,
        p.tokens_per_step,
    )
    assert p.reason.endswith(in_samples.reason)


@pytest.mark.skipif(not _records_length(), reason="Result records no sized_on")
def test_plan_probes_at_seq_len_and_the_result_remembers_it() -> None:
    torch.manual_seed(0)
    made: list[tuple[int, int]] = []

    def make(b: int, s: int) -> torch.Tensor:
        made.append((b, s))
        return torch.randint(0, 50, (b, s))

    p = plan(_TinyLM(), make_batch=make, target_tokens=1000 * SEQ, seq_len=SEQ, memory_limit="2MiB", verify_steps=1)
    assert {s for _, s in made} == {SEQ}  # seq_len is find's too: the probe sized at the length planned on
    assert (p.target_batch, p.tokens_per_step) == (1000, 1000 * SEQ)
    # A result that records its length plans in tokens without seq_len=.
    sized = batchfit.find(_TinyLM(), torch.randint(0, 50, (2, 64)), seq_len=SEQ, memory_limit="2MiB", verify_steps=1)
    if getattr(sized.sized_on, "length", None) == SEQ:
        q = plan(sized, target_tokens=1000 * SEQ)
        assert q.seq_len == SEQ and f"seq_len {SEQ} is the length the probe sized on" in q.reason
        assert "sized on sequences of 16 tokens, not 32" in plan(sized, target_tokens=1000 * 32, seq_len=32).reason


def test_a_frontier_plans_on_its_point_at_seq_len(real: Result, lm: Result) -> None:
    frontier_module = pytest.importorskip("batchfit.report.frontier")
    long = _result(real, safe=8)
    frontier = frontier_module.Frontier(
        points=(frontier_module.FrontierPoint.of(SEQ, lm), frontier_module.FrontierPoint.of(4 * SEQ, long)),
        surface=None,
        budget_bytes=lm.budget_bytes,
        budget_counts=lm.budget_counts,
        device=lm.device,
        elapsed_s=0.0,
    )
    p = plan(frontier, target_tokens=256 * 4 * SEQ, seq_len=4 * SEQ)
    assert (p.micro_batch, p.accumulation_steps, p.safe_batch) == (8, 32, 8)  # the point at 64's result
    assert p.tokens_per_step == 256 * 4 * SEQ
    assert p.reason.startswith("planned on the frontier's point at seq_len 64 (max batch 18, safe batch 8)")
    assert plan_for(frontier, 64, seq_len=SEQ).safe_batch == lm.safe_batch
    with pytest.raises(ValueError, match="a frontier has a point per length \\(16, 64\\): pass seq_len="):
        plan(frontier, target_tokens=4096)
    with pytest.raises(ValueError, match="no point at seq_len=32; its lengths: 16, 64"):
        plan_for(frontier, target_tokens=4096, seq_len=32)
    with pytest.raises(TypeError, match="given a Frontier, so there is no probe to pass sample"):
        plan(frontier, torch.zeros(1), target_tokens=4096, seq_len=SEQ)


@pytest.mark.slow
def test_cli_plans_in_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    from batchfit import cli

    args = ["estimate", "batchfit.examples:gpt", "--memory-limit", "32MiB", "--device", "cpu", "--seq-len", "32"]
    assert cli.main([*args, "--target-tokens", "5000", "--target-batch", "4"]) == 2
    assert "--target-batch (samples) or --target-tokens (tokens per step), not both" in capsys.readouterr().err
    assert cli.main([*args, "--target-tokens", "31"]) == 2
    assert "--target-tokens 31 is less than one sequence of --seq-len 32" in capsys.readouterr().err
    assert cli.main([*args, "--target-tokens", "5000"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("plan"))
    assert "5,024 tokens/step = global batch 157 x 32 tokens" in line and "24 tokens over the target 5,000" in line
