"""Elastic jobs: a result measured on some ranks, re-planned for more or fewer without a new probe.

An elastic job (torchrun ``--nnodes 1:4``, Ray Train's ``ScalingConfig(num_workers=(min, max))``)
restarts with another world size; the global batch the learning rate was tuned for must stay,
split over the new ranks (``Result.recommend(target_batch=..., world_size=...)``), and when it
cannot be kept exactly the recommendation says by how much. The result is a real probe's (a tiny
MLP under a CPU memory limit), with its safe batch and world size set by hand so that the
arithmetic is pinned on exact numbers: the rules read nothing else.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import batchfit
from batchfit.report import Result


@pytest.fixture(scope="module")
def two_ranks() -> Result:
    """A real probe's answer, as if two ranks had measured a safe batch of 48 each."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    real = batchfit.find(model, torch.randn(4, 64), memory_limit="2MiB", verify_steps=1, timed_steps=0)
    return dataclasses.replace(real, max_batch=max(real.max_batch, 56), safe_batch=48, world_size=2)


@pytest.mark.parametrize(("world_size", "micro", "steps"), [(1, 48, 8), (2, 48, 4), (4, 48, 2), (3, 32, 4), (8, 48, 1)])
def test_the_global_batch_is_kept_exactly_on_any_world_size_that_divides_it(
    two_ranks: Result, world_size: int, micro: int, steps: int
) -> None:
    rec = two_ranks.recommend(target_batch=384, world_size=world_size)
    assert (rec.batch_size, rec.accumulation, rec.world_size) == (micro, steps, world_size)
    assert rec.global_batch == 384 and rec.exact and rec.target_changed_by == 0
    assert rec.batch_size <= two_ranks.safe_batch
    replanned = [caveat for caveat in rec.caveats if caveat.startswith("re-planned")]
    if world_size == two_ranks.world_size:
        assert not replanned
    else:
        rank_word = "rank" if world_size == 1 else "ranks"
        assert replanned == [
            f"re-planned for {world_size} {rank_word} from a probe on 2 ranks, without a new probe: a rank's batch "
            "sizes and memory hold on the same device kind; the samples/s are those 2 ranks measured"
        ]


@pytest.mark.parametrize("world_size", [5, 7, 9])
def test_a_world_size_that_cannot_keep_it_says_by_how_much(two_ranks: Result, world_size: int) -> None:
    rec = two_ranks.recommend(target_batch=384, world_size=world_size)
    assert rec.world_size == world_size and rec.batch_size <= 48
    assert rec.global_batch == rec.batch_size * rec.accumulation * world_size
    assert rec.target_changed_by == rec.global_batch - 384 != 0 and not rec.exact
    # the nearest split with the fewest passes: no other split with as few passes is nearer
    nearest = min(abs(m * rec.accumulation * world_size - 384) for m in range(1, 49))
    assert abs(rec.target_changed_by) == nearest
    change = rec.target_changed_by
    off = f"{abs(change)} over" if change > 0 else f"{abs(change)} short of"
    assert f"the target global batch 384 becomes {rec.global_batch}, {off} it" in rec.reason
    assert f"over {world_size} ranks reaches it" in rec.reason


def test_the_re_plan_reads_the_same_from_a_document(two_ranks: Result) -> None:
    """An elastic restart may only have the JSON of the first run's answer."""
    again = Result.from_json(two_ranks.to_json())
    assert again.recommend(target_batch=384, world_size=4) == two_ranks.recommend(target_batch=384, world_size=4)


def test_without_a_target_the_rules_apply_per_rank_on_the_new_ranks(two_ranks: Result) -> None:
    rec = two_ranks.recommend(world_size=4)
    assert rec.world_size == 4 and rec.batch_size == two_ranks.recommend().batch_size
    assert any(caveat.startswith("re-planned for 4 ranks") for caveat in rec.caveats)


@pytest.mark.parametrize(
    ("world_size", "error", "match"),
    [(0, ValueError, "world_size"), (-2, ValueError, "world_size"), (2.0, TypeError, "world_size"),
     ("4", TypeError, "world_size"), (True, TypeError, "world_size")],
)  # fmt: skip
def test_a_bad_world_size_is_named(two_ranks: Result, world_size: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        two_ranks.recommend(target_batch=384, world_size=world_size)  # type: ignore[arg-type]


def test_the_command_re_plans_for_another_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    """``batchfit probe --target-batch N --world-size W``: the plan and the recommendation for W ranks."""
    from batchfit.cli import main

    args = ["probe", "batchfit.examples:mlp", "--device", "cpu", "--memory-limit", "32MiB", "--verify-steps", "1"]
    code = main([*args, "--timed-steps", "0", "--target-batch", "96", "--world-size", "4", "--quiet"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    plan = next(line for line in stdout.splitlines() if line.startswith("plan "))
    assert "global batch 96 = 4 ranks x micro-batch " in plan and "(exact)" in plan
    with pytest.raises(SystemExit) as usage:
        main([*args, "--world-size", "0"])
    assert usage.value.code == 2
    assert "--world-size" in capsys.readouterr().err
