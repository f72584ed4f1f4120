"""An uneven split's passes (``split_uneven``, ``recommend(uneven=True)``): the fewest passes whose
global batch is within `TARGET_TOLERANCE` of the target, found in bounded time for any target (a
prime one included); the answer says when the target moved and when the split gains nothing over
the even one; `UnevenShare`'s own example runs.

Pure arithmetic on a result built from its fields (the split reads only the per-rank safe batches);
the probe that makes such a result is `tests/test_uneven.py`'s.
"""

from __future__ import annotations

import itertools
import random
import re
import threading
from typing import Any

import pytest

from batchfit.distributed import uneven_split
from batchfit.distributed.uneven_share import UnevenShare
from batchfit.report import RankBatch, Recommendation, Result, UnevenSplit
from batchfit.report.records import DeviceInfo, Settings
from batchfit.report.uneven import TARGET_TOLERANCE, split_uneven, weights_of

#: A prime global batch: the old search tried every pass count up to G / ranks (hours).
PRIME = 999_999_999_989
#: Only so that a regression fails instead of hanging the run; nothing asserts a time.
GUARD_S = 30


def _returns(call: Any) -> Any:
    """``call()``'s value, or a failure (not a hang) when it has not returned within `GUARD_S`."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(GUARD_S)
    assert out, f"did not return within {GUARD_S} s"
    return out[0]


def _ranks(*safe: int) -> Result:
    """A two-or-more-rank result whose ranks' own safe batches are ``safe`` (the group's is the smallest)."""
    answers = tuple(
        RankBatch(rank=r, max_batch=s + 1, safe_batch=s, budget_bytes=None, safe_verified=True, boundary_reached=True)
        for r, s in enumerate(safe)
    )
    return Result(
        max_batch=min(safe) + 1,
        safe_batch=min(safe),
        best_throughput_batch=min(safe),
        budget_bytes=None,
        boundary_reached=True,
        stop_reason="boundary",
        non_monotone=False,
        safe_verified=True,
        trials=(),
        memory=None,
        device=DeviceInfo(type="cpu"),
        settings=Settings(),
        elapsed_s=0.0,
        torch_version="",
        batchfit_version="",
        world_size=len(safe),
        per_rank=answers,
    )


def _brute(target: int, safe: tuple[int, ...], tolerance: float) -> tuple[int, int]:
    """``(samples per pass, passes)`` by trying every pair: the fewest passes (at least those that
    hold ``target``) within the tolerance, the nearest among them (more samples on a tie); none
    within it: the fewest passes, nearest."""
    ranks, total = len(safe), sum(safe)
    fewest = -(-target // total)
    slack = int(tolerance * target)
    sizes = range(ranks, total + 1)
    passes = next((p for p in range(fewest, target + 1) if any(abs(t * p - target) <= slack for t in sizes)), fewest)
    per_pass = min(sizes, key=lambda t: (abs(t * passes - target), -t))
    return per_pass, passes


# The arithmetic -------------------------------------------------------------------------------------
def test_a_prime_target_returns_with_the_fewest_passes() -> None:
    micro, passes = _returns(lambda: split_uneven(PRIME, (64, 32)))
    assert (micro, passes) == ((64, 32), 10_416_666_667)  # 96 a pass: 1,000,000,000,032, 43 over
    assert abs(sum(micro) * passes - PRIME) <= TARGET_TOLERANCE * PRIME


def test_the_fewest_passes_within_the_tolerance_not_a_million_of_two_samples() -> None:
    assert split_uneven(3_000_009, (526, 263)) == ((526, 263), 3803)  # 3,000,567: 558 over, 0.02%
    assert split_uneven(4096, (10, 5)) == ((10, 5), 274)  # 4110: 14 over, 0.3%; exact needs 512
    assert split_uneven(4096, (10, 5), tolerance=0) == ((5, 3), 512)  # exact only
    assert split_uneven(13, (3, 2), tolerance=0) == ((2, 2), 3)  # nothing exact: the fewest passes, nearest


def test_the_split_agrees_with_trying_every_pair() -> None:
    rng = random.Random(0)
    cases = [(t, s) for s in itertools.product(range(1, 5), repeat=2) for t in range(2, 60)]
    cases += [(rng.randint(50, 400), tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 3)))) for _ in range(30)]
    for tolerance in (0.0, TARGET_TOLERANCE, 0.05):
        for target, safe in cases:
            if target < len(safe):
                continue
            micro, passes = split_uneven(target, safe, tolerance=tolerance)
            assert (sum(micro), passes) == _brute(target, safe, tolerance), (target, safe, tolerance)
            assert all(1 <= b <= s for b, s in zip(micro, safe)), (target, safe, micro)


def test_a_tolerance_outside_0_to_1_is_refused() -> None:
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="tolerance"):
            split_uneven(96, (40, 20), tolerance=bad)


# The recommendation --------------------------------------------------------------------------------
def test_recommend_with_a_prime_target_returns_and_says_what_it_became() -> None:
    rec = _returns(lambda: _ranks(64, 32).recommend(target_batch=PRIME, uneven=True))
    assert rec.uneven is not None and rec.uneven.global_batch == 1_000_000_000_032
    (said,) = [c for c in rec.caveats if "uneven" in c]
    assert "999999999989" in said and "1000000000032" in said and "43 over" in said, said


def test_a_target_the_uneven_split_cannot_meet_is_said_in_a_caveat() -> None:
    rec = _ranks(10, 5).recommend(target_batch=1_000_003, uneven=True)
    assert rec.uneven is not None and rec.uneven.global_batch == 1_000_005
    (said,) = [c for c in rec.caveats if "uneven" in c]
    assert "target 1000003" in said and "1000005, 2 over" in said and f"{TARGET_TOLERANCE:.0%}" in said, said
    exact = _ranks(40, 20).recommend(target_batch=96, uneven=True)
    assert not [c for c in exact.caveats if "uneven" in c]  # reached exactly: nothing to say
    assert Recommendation.from_dict(_asdict(rec)) == rec


def test_an_uneven_split_that_gains_nothing_says_so() -> None:
    rec = _ranks(10, 5).recommend(target_batch=20, uneven=True)  # even: 5 x 2 passes; uneven 7 + 3 x 2
    assert rec.uneven is not None and rec.uneven.accumulation == rec.accumulation == 2
    assert rec.uneven.reason.startswith("gains nothing over the even split"), rec.uneven.reason
    assert "in proportion" not in rec.uneven.reason
    gains = _ranks(10, 5).recommend(target_batch=4096, uneven=True)  # even: 4 x 512 passes
    assert gains.uneven is not None
    assert "274 passes per step instead of 512" in gains.uneven.reason, gains.uneven.reason


def test_the_reason_never_misreads_the_split_as_even() -> None:
    rec = _ranks(5, 5).recommend(target_batch=9, uneven=True)  # even: 5 x 2 ranks, 1 over
    assert rec.uneven is not None and (rec.uneven.micro_batches, rec.uneven.accumulation) == ((5, 4), 1)
    assert "split is even" not in rec.uneven.reason and "nearer the target" in rec.uneven.reason


# The training loop's share ---------------------------------------------------------------------------
def test_the_share_s_own_example_runs() -> None:
    micro = (32, 16)
    plan = UnevenSplit(micro, accumulation=2, global_batch=96, loss_weights=weights_of(micro), safe_batches=(40, 20))
    doc = UnevenShare.__doc__ or ""
    (example,) = re.findall(r"``([^`]*= uneven_split\([^`]*\))``", doc)
    names: dict[str, Any] = {"uneven_split": uneven_split, "plan": plan}
    exec(example.replace("...", "plan, rank=1"), names)  # noqa: S102 - the docstring's own line
    assert names["part"] == slice(32, 48) and names["weight"] == pytest.approx(2 / 3)


def _asdict(rec: Recommendation) -> dict[str, Any]:
    import dataclasses
    import json

    return json.loads(json.dumps(dataclasses.asdict(rec)))
