"""Every answer type reads back what it writes: ``X.from_json(x.to_json()) == x`` (issue 49, item 5).

The result, the evaluation answer and a frontier come from a real (tiny) probe (over a second on
2 cores: marked slow); the fit, the noise scale and an uneven split are built as their functions
build them (a real fit's round trip is in tests/test_checkpointing.py). One boundary record: each
answer that has one reads it alike.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Any

import pytest
import torch
from torch import nn

import batchfit
from batchfit.report import (
    DeviceInfo,
    Evaluation,
    Fit,
    Frontier,
    FrontierPoint,
    NoiseScale,
    Policy,
    PolicyRow,
    RankBatch,
    Recommendation,
    Result,
    Surface,
    UnevenSplit,
)
from batchfit.report.boundary import Boundary
from batchfit.report.uneven import split_uneven, weights_of

BOUNDARY = ("max_batch", "safe_batch", "safe_verified", "boundary_reached")


@pytest.fixture(scope="module")
def result() -> Result:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    return batchfit.find(model, torch.randn(1, 32), memory_limit="64KiB", timed_steps=2)


def _round_trip(answer: Any) -> None:
    kind = type(answer)
    text = answer.to_json()
    again = kind.from_json(text)
    assert again == answer and again.to_json() == text
    assert kind.from_dict(json.loads(text)) == answer == kind.from_dict(answer.to_dict())


@pytest.mark.slow
def test_a_result_and_its_evaluation_answer_read_back(result: Result) -> None:
    _round_trip(result)
    evaluation = Evaluation.of(result)
    _round_trip(evaluation)
    _round_trip(replace(result, evaluation=evaluation))


@pytest.mark.slow
def test_a_frontier_reads_back_with_each_point_s_boundary_from_its_result(result: Result) -> None:
    points = (FrontierPoint.of(32, result), FrontierPoint.of(64, result))
    surface = Surface.fit([(32, 1000.0, 320.0), (64, 1000.0, 700.0)])
    frontier = Frontier(points, surface, result.budget_bytes, result.budget_counts, result.device, 1.5)
    _round_trip(frontier)
    written = json.loads(frontier.to_json())["points"][0]
    assert (written["max_batch"], written["safe_batch"]) == (result.max_batch, result.safe_batch)  # for readers


def _row(k: int, max_batch: int, safe: int, micro: int, rate: float) -> PolicyRow:
    policy = Policy(tuple(f"blocks.{i}" for i in range(k)), 4)
    boundary = Boundary(max_batch=max_batch, safe_batch=safe, safe_verified=True, boundary_reached=k > 0)
    return PolicyRow(policy, 44_000_000, 2_900_000.0 / (k + 1), 6, micro, -(-162 // micro), rate, **asdict(boundary))


def test_a_fit_reads_back_what_it_writes() -> None:
    rows = (_row(0, 91, 81, 81, 210.5), _row(3, 185, 164, 162, 171.8))
    chosen = Recommendation(81, 2, 1, 162, "target", "the fastest measured", 91, 81, 81, samples_per_s=210.5,
                            target=162, target_changed_by=0)  # fmt: skip
    names = tuple(f"blocks.{i}" for i in range(4))
    fit = Fit(162, names, "blocks", rows, 0, chosen, ((0, 91), (3, 185)), 300 * 2**20, "allocated",
              DeviceInfo(type="cpu"), 9, 12.5, notes=("a note",))  # fmt: skip
    _round_trip(fit)
    policy = {"checkpointed": [], "blocks": 4, "placement": "first", "budget": None}
    assert json.loads(fit.to_json())["policy"] == policy  # derived, for readers
    assert Fit.from_json(fit.to_json()).rows[1].boundary_reached


def test_a_noise_scale_reads_back_bounded_or_not() -> None:
    windows = [(4.0 + i % 3, 1.0 + (i % 2) * 0.5) for i in range(6)]
    noise = NoiseScale.from_windows(windows, 4, 16, passes=24, samples=96, elapsed_s=0.25)
    _round_trip(noise)
    _round_trip(replace(noise, b_simple=None, high=None, source="ranks", world_size=2))


def test_an_uneven_split_reads_back_and_is_checked_on_reading() -> None:
    micro, passes = split_uneven(1000, (40, 23, 17))
    split = UnevenSplit(micro, passes, sum(micro) * passes, weights_of(micro), (40, 23, 17), "by safe batch")
    _round_trip(split)
    document = split.to_dict() | {"global_batch": split.global_batch + 1}
    with pytest.raises(ValueError, match="not a batchfit uneven split: global_batch"):
        UnevenSplit.from_dict(document)


@pytest.mark.parametrize("owner", ["Recommendation", "WhatIf"])
def test_the_other_answers_read_back(owner: str) -> None:
    if owner == "Recommendation":
        answer: Any = Recommendation(20, 2, 2, 80, "target", "target 80", 30, 20, 20, target=80, target_changed_by=0)
    else:
        from batchfit.estimation.whatif import WhatIf, WhatIfRow

        answer = WhatIf(memory_bytes=2**30, device="cpu", rows=(WhatIfRow("bf16", max_batch=12, safe_batch=10),))
    if not hasattr(answer, "from_json"):
        pytest.skip(f"{owner} has no JSON methods yet (its owner adds them: batchfit.report.codec.JsonRecord)")
    _round_trip(answer)


@pytest.mark.slow
def test_one_boundary_record_is_shared_by_every_answer_that_has_one(result: Result) -> None:
    rank = RankBatch(0, 2**20, max_batch=9, safe_batch=8, safe_verified=True, boundary_reached=True)
    for answer in (result, Evaluation.of(result), rank, _row(0, 91, 81, 81, 1.0), FrontierPoint.of(32, result)):
        boundary = Boundary.of(answer)
        assert [getattr(boundary, name) for name in BOUNDARY] == [getattr(answer, name) for name in BOUNDARY]
    assert Boundary.of(FrontierPoint.of(32, result)) == Boundary.of(result)
    with pytest.raises(TypeError):
        RankBatch(0, 9, 8, None, True, True)  # type: ignore[misc]  # the boundary is keyword-only
    with pytest.raises(ValueError, match="field 'per_rank\\[0\\].safe_batch' must not exceed"):
        Result.from_dict(replace(result, per_rank=(replace(rank, safe_batch=10),)).to_dict())
