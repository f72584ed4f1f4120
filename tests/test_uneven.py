"""Ranks that fit different batches: one global batch split unevenly, with the loss weights that keep
the gradient the mean over every sample (``Result.recommend(uneven=True)``, `uneven_split`).

The split arithmetic is checked against a brute force on small numbers; the recommendation starts
from a real probe's result with hand-made per-rank answers; the last test runs two real ranks with
2:1 memory (``tests/uneven_job.py``) and compares their all-reduced gradient with one process's on
every sample.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import batchfit
from batchfit.distributed import uneven_split
from batchfit.distributed.uneven_share import UnevenShare
from batchfit.report import RankBatch, Recommendation, Result, UnevenSplit
from batchfit.report.uneven import split_uneven, weights_of

TESTS = Path(__file__).parent
JOB_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def real() -> Result:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return batchfit.find(model, torch.randn(4, 32), memory_limit="1MiB", verify_steps=0, timed_steps=0, max_batch=64)


def _ranks(real: Result, *safe: int) -> Result:
    """``real`` as if probed on ``len(safe)`` ranks whose own safe batches are ``safe``."""
    answers = tuple(
        RankBatch(
            rank=r,
            max_batch=s + 4,
            safe_batch=s,
            budget_bytes=(r + 1) * 2**20,
            safe_verified=True,
            boundary_reached=True,
        )
        for r, s in enumerate(safe)
    )
    return dataclasses.replace(
        real, world_size=len(safe), safe_batch=min(safe), max_batch=min(safe) + 4, per_rank=answers
    )


# The arithmetic -------------------------------------------------------------------------------------
def test_the_split_follows_what_each_rank_fits() -> None:
    assert split_uneven(96, [40, 20]) == ((32, 16), 2)
    assert split_uneven(60, [40, 20]) == ((40, 20), 1)
    assert split_uneven(7, [5, 2]) == ((5, 2), 1)
    assert split_uneven(10, [3, 3, 3]) == ((2, 2, 1), 2)  # the remainder to the lower ranks on a tie
    assert split_uneven(13, [3, 2]) == ((2, 2), 3)  # 13 is prime: the nearest, 12


def test_the_split_is_exact_with_the_fewest_passes_and_near_each_share() -> None:
    for ranks in (1, 2, 3):
        for safe in itertools.product(range(1, 6), repeat=ranks):
            total = sum(safe)
            for target in range(ranks, 41):
                micro, steps = split_uneven(target, list(safe))
                per_pass = sum(micro)
                assert all(1 <= b <= s for b, s in zip(micro, safe)), (target, safe, micro)
                shares = [per_pass * s / total for s in safe]
                if min(shares) >= 1:  # else a rank's one sample comes out of the others' shares
                    assert all(abs(b - share) < 1 for b, share in zip(micro, shares)), (target, safe, micro)
                exact = [a for a in range(1, target + 1) if target % a == 0 and ranks <= target // a <= total]
                if exact:
                    assert (per_pass * steps, steps) == (target, min(exact)), (target, safe)
                else:
                    fewest = -(-target // total)
                    best = min(abs(t * fewest - target) for t in range(ranks, total + 1))
                    assert steps == fewest and abs(per_pass * steps - target) == best, (target, safe)


def test_the_weights_make_the_mean_of_every_sample() -> None:
    rng = random.Random(0)
    for _ in range(200):
        safe = [rng.randint(1, 50) for _ in range(rng.randint(1, 5))]
        target = rng.randint(len(safe), 400)
        micro, _ = split_uneven(target, safe)
        values = [rng.uniform(-5, 5) for _ in range(sum(micro))]
        means, start = [], 0
        for b in micro:
            means.append(sum(values[start : start + b]) / b)
            start += b
        weights = weights_of(micro)
        assert sum(weights) == pytest.approx(len(micro))
        # DDP averages the ranks' weighted means: the mean over every sample of the pass.
        assert sum(w * m for w, m in zip(weights, means)) / len(micro) == pytest.approx(sum(values) / len(values))


def test_impossible_splits_say_why_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="target_batch 1 is smaller than the 2 ranks"):
        split_uneven(1, [4, 2])
    with pytest.raises(ValueError, match="rank 1 fits no sample"):
        split_uneven(8, [4, 0])
    with pytest.raises(TypeError, match="target_batch must be an int"):
        split_uneven("8", [4, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="target_batch must be positive"):
        split_uneven(0, [4, 2])
    with pytest.raises(ValueError, match="at least one rank"):
        split_uneven(8, [])
    with pytest.raises(ValueError, match="loss_weights\\[0\\]"):
        UnevenSplit(micro_batches=(2, 1), accumulation=1, global_batch=3, loss_weights=(1.0, 1.0), safe_batches=(2, 1))


# The recommendation --------------------------------------------------------------------------------
def test_recommend_splits_the_target_by_each_ranks_safe_batch(real: Result) -> None:
    result = _ranks(real, 40, 20)
    rec = result.recommend(target_batch=96, uneven=True)
    assert rec.uneven is not None
    assert (rec.uneven.micro_batches, rec.uneven.accumulation, rec.uneven.global_batch) == ((32, 16), 2, 96)
    assert rec.uneven.loss_weights == pytest.approx((4 / 3, 2 / 3))
    assert (rec.batch_size, rec.accumulation, rec.global_batch) == (16, 3, 96)  # the even split, for comparison
    assert "2 passes per step instead of 3" in rec.uneven.reason
    text = str(rec)
    assert "uneven           micro-batches 32 + 16 on ranks 0, 1 x 2 accumulation steps (global batch 96)" in text
    assert "loss weights     rank 0 x1.333, rank 1 x0.6667: loss = weight x the rank's mean loss / 2" in text
    assert Recommendation.from_dict(json.loads(json.dumps(dataclasses.asdict(rec)))) == rec
    assert result.recommend(target_batch=96).uneven is None


def test_the_per_rank_answers_travel_in_the_result(real: Result) -> None:
    result = _ranks(real, 40, 20)
    assert Result.from_json(result.to_json()) == result
    assert "rank 1             max batch 24, safe batch 20 (verified) on 2.00 MiB" in str(result)
    broken = json.loads(result.to_json())
    broken["per_rank"][0]["safe_batch"] = 99
    with pytest.raises(ValueError, match="per_rank\\[0\\].safe_batch' must not exceed"):
        Result.from_dict(broken)


def test_without_a_target_the_chosen_global_batch_is_split(real: Result) -> None:
    result = _ranks(real, 30, 10)
    rec = result.recommend(uneven=True)
    assert rec.uneven is not None and rec.uneven.global_batch == rec.global_batch


def test_ranks_that_probed_alike_split_evenly(real: Result) -> None:
    result = dataclasses.replace(real, world_size=2)
    rec = result.recommend(target_batch=2 * result.safe_batch, uneven=True)
    assert rec.uneven is not None
    assert rec.uneven.micro_batches == (result.safe_batch,) * 2 and rec.uneven.loss_weights == (1.0, 1.0)
    assert "the split is even" in rec.uneven.reason


def test_bad_uneven_requests_name_the_problem(real: Result) -> None:
    result = _ranks(real, 40, 20)
    with pytest.raises(ValueError, match="target_batch 1 is smaller than the 2 ranks"):
        result.recommend(target_batch=1, uneven=True)
    with pytest.raises(TypeError, match="uneven must be True or False"):
        result.recommend(target_batch=8, uneven="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="splits over the 2 ranks that probed"):
        result.recommend(target_batch=96, uneven=True, world_size=3)
    with pytest.raises(TypeError, match="target_batch must be an int"):
        result.recommend(target_batch=9.5, uneven=True)  # type: ignore[arg-type]


# The training loop's helper ------------------------------------------------------------------------
def test_uneven_split_hands_each_rank_its_slice_and_weight(real: Result) -> None:
    rec = _ranks(real, 30, 20, 10).recommend(target_batch=120, uneven=True)
    shares = [uneven_split(rec, rank) for rank in range(3)]
    assert shares[0] == UnevenShare(slice(0, 30), 1.5, 30, 2, 60)
    assert [s.part for s in shares] == [slice(0, 30), slice(30, 50), slice(50, 60)]
    part, weight, micro, steps, per_pass = shares[2]
    assert (part, micro, steps, per_pass) == (slice(50, 60), 10, 2, 60) and weight == pytest.approx(0.5)
    assert uneven_split(rec.uneven, 1) == shares[1]  # type: ignore[arg-type]
    assert uneven_split(rec) == shares[0]  # no process group: rank 0
    with pytest.raises(ValueError, match="rank 3 is not one of the split's 3 ranks"):
        uneven_split(rec, 3)
    with pytest.raises(ValueError, match="recommend\\(..., uneven=True\\)"):
        uneven_split(real.recommend(target_batch=8), 0)
    with pytest.raises(TypeError, match="plan must be a Recommendation or an UnevenSplit"):
        uneven_split(real, 0)  # type: ignore[arg-type]


# Two real ranks ------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_two_ranks_with_2_to_1_memory_train_the_mean_gradient_of_one_global_batch(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(TESTS / "uneven_job.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records: list[dict[str, Any]] = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for rank, record in enumerate(records):
        assert "crash" not in record, f"rank {rank}:\n{record['crash']}"
    result = Result.from_json(records[0]["result"])
    assert Result.from_json(records[1]["result"]).per_rank == result.per_rank
    big, small = result.per_rank
    assert (big.rank, small.rank) == (0, 1) and big.budget_bytes == 2 * small.budget_bytes
    assert big.max_batch > small.max_batch and big.safe_batch > small.safe_batch
    assert big.safe_verified and small.safe_verified
    assert (result.max_batch, result.safe_batch) == (small.max_batch, small.safe_batch)  # the group's: unchanged
    for record in records:
        for mine, reference in zip(record["uneven"], record["reference"]):
            torch.testing.assert_close(mine, reference)
    unweighted = records[0]["unweighted"]
    assert not all(torch.allclose(a, b) for a, b in zip(unweighted, records[0]["reference"]))
    starts = [record["share"][0] for record in records]
    assert starts[0] == 0 and starts[1] == records[0]["share"][1]  # rank 1's part starts where rank 0's ends


def test_a_rank_share_is_the_splits_own(real: Result) -> None:
    split = _ranks(real, 60, 20).recommend(target_batch=60, uneven=True).uneven
    assert split is not None
    assert split.share(0) == tuple(uneven_split(split, 0)) and uneven_split(split, 1).weight == split.share(1)[1]
    with pytest.raises(ValueError, match="rank 2 is not one of the split's 2 ranks"):
        split.share(2)
    with pytest.raises(TypeError, match="rank must be an int"):
        split.share(True)
