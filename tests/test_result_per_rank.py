"""``Result.per_rank`` holds one answer per rank (issue 48): a document that lists a rank twice was
accepted, and an uneven split then ran over ranks that do not exist. Refused where a result is read
(``from_dict``, ``from_json``: the cache, ``--result`` files) and where one is made."""

from __future__ import annotations

import dataclasses
import json

import pytest

from batchfit.report import RankBatch, Result
from batchfit.report.records import DeviceInfo, Settings


def _two_ranks() -> Result:
    answers = tuple(
        RankBatch(rank=r, max_batch=s + 4, safe_batch=s, budget_bytes=None, safe_verified=True, boundary_reached=True)
        for r, s in enumerate((40, 20))
    )
    return Result(
        max_batch=24, safe_batch=20, best_throughput_batch=20, budget_bytes=None, boundary_reached=True,
        stop_reason="boundary", non_monotone=False, safe_verified=True, trials=(), memory=None,
        device=DeviceInfo(type="cpu"), settings=Settings(), elapsed_s=0.0, torch_version="", batchfit_version="",
        world_size=2, per_rank=answers,
    )  # fmt: skip


def test_a_document_with_each_rank_once_loads() -> None:
    result = _two_ranks()
    assert Result.from_json(result.to_json()).per_rank == result.per_rank


@pytest.mark.parametrize("read", ["from_dict", "from_json"])
def test_a_document_that_lists_a_rank_twice_is_refused_by_name(read: str) -> None:
    document = json.loads(_two_ranks().to_json())
    document["per_rank"][1]["rank"] = 0
    given = document if read == "from_dict" else json.dumps(document)
    with pytest.raises(ValueError, match=r"^not a batchfit result: field 'per_rank' lists rank 0 more than once"):
        getattr(Result, read)(given)


def test_a_result_made_with_a_rank_twice_is_refused() -> None:
    result = _two_ranks()
    twice = (result.per_rank[0], dataclasses.replace(result.per_rank[1], rank=0))
    with pytest.raises(ValueError, match="lists rank 0 more than once"):
        dataclasses.replace(result, per_rank=twice)
