"""``batchfit probe --memory-limit-per-rank`` and ``--uneven`` (issue 48): what ``find(memory_limit=limits[rank])``
and ``Result.recommend(uneven=True)`` give from Python, on the command line.

The flags are checked in-process (``main()``, and `probe_plan` with the real `Launch` a rank of
``torchrun`` reads from its environment); one ``distributed`` test runs two gloo ranks under
``torchrun`` with 2:1 limits and reads each rank's own answer and the uneven split.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchfit.cli import main
from batchfit.cli.arguments import probe_plan
from batchfit.cli.output import UsageError
from batchfit.cli.parser import build_parser
from batchfit.distributed import from_environment
from batchfit.probe.options import check_rank_limits

FAST = ["--device", "cpu", "--memory-limit", "64MiB", "--max-batch", "8", "--verify-steps", "0", "--timed-steps", "0"]


def rank_of_two(rank: int) -> object:
    """The `Launch` rank ``rank`` of a two-rank ``torchrun`` job reads from its environment."""
    return from_environment({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"})


# --memory-limit-per-rank ------------------------------------------------------------------------
@pytest.mark.parametrize("rank, limit", [(0, "63.5MB"), (1, "38.3MB")])
def test_each_rank_probes_under_its_own_limit(rank: int, limit: str) -> None:
    args = build_parser().parse_args(
        ["probe", "m.py:build", "--device", "cpu", "--memory-limit-per-rank", "0=63.5MB,1=38.3MB"]
    )
    _, chosen, header, expected = probe_plan(args, rank_of_two(rank))  # type: ignore[arg-type]
    assert chosen == limit
    assert expected == int(float(limit[:-2]) * 10**6)
    assert f"(--memory-limit-per-rank for rank {rank})" in header[1]


def test_a_rank_not_listed_takes_memory_limit_and_the_flag_repeats() -> None:
    args = build_parser().parse_args(
        ["probe", "m.py:build", "--device", "cpu", "--memory-limit", "20MiB", "--memory-limit-per-rank", "1=10MiB"]
    )
    assert probe_plan(args, rank_of_two(0))[1] == "20MiB"  # type: ignore[arg-type]
    repeated = build_parser().parse_args(
        ["probe", "m.py:build", "--memory-limit-per-rank", "0=1GiB", "--memory-limit-per-rank", "1=2GiB"]
    )
    assert probe_plan(repeated, rank_of_two(1))[1] == "2GiB"  # type: ignore[arg-type]


def test_a_rank_listed_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["probe", "batchfit.examples:mlp", *FAST, "--memory-limit-per-rank", "0=63.5MB,1=38.3MB,0=1GB"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "batchfit: error: argument --memory-limit-per-rank: '0=63.5MB,1=38.3MB,0=1GB' lists rank 0 twice" in err
    # ... across uses of the flag too, and a rank the job does not have: when the rank knows its job
    twice = build_parser().parse_args(
        ["probe", "m.py:build", "--memory-limit-per-rank", "0=1GiB", "--memory-limit-per-rank", "0=2GiB"]
    )
    with pytest.raises(UsageError, match="lists rank 0 twice"):
        probe_plan(twice, rank_of_two(0))  # type: ignore[arg-type]
    outside = build_parser().parse_args(["probe", "m.py:build", "--memory-limit-per-rank", "0=1GiB,2=1GiB"])
    with pytest.raises(UsageError, match=r"names rank 2, but the job has 2 ranks \(0 to 1\)"):
        probe_plan(outside, rank_of_two(0))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value, match",
    [("0=5XB", "rank 0's limit '5XB' has an unknown unit"), ("x=1GiB", "is not a whole number"), ("0", "RANK=SIZE")],
)
def test_bad_per_rank_limits_name_the_problem(value: str, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["probe", "batchfit.examples:mlp", "--memory-limit-per-rank", value])
    assert match in capsys.readouterr().err


def test_the_validation_is_the_options_one() -> None:
    assert check_rank_limits([(0, "1GiB"), (1, 0.5)], 2) == {0: "1GiB", 1: 0.5}
    with pytest.raises(ValueError, match="lists rank 1 twice"):
        check_rank_limits([(1, "1GiB"), (1, "2GiB")])
    with pytest.raises(ValueError, match="a rank is a whole number from 0"):
        check_rank_limits([(True, "1GiB")])


@pytest.mark.parametrize(
    "extra, said",
    [
        ([], "run it under torchrun"),
        (["--nproc-per-trial", "2"], "the jobs of --nproc-per-trial take one --memory-limit"),
    ],
)
def test_per_rank_limits_without_a_torchrun_probe_are_refused(
    extra: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["probe", "batchfit.examples:mlp", *FAST, "--memory-limit-per-rank", "0=1GiB", *extra]) == 2
    assert said in capsys.readouterr().err


# --uneven ---------------------------------------------------------------------------------------
def test_uneven_prints_the_split_and_its_loss_weights(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "batchfit.examples:mlp", *FAST, "--max-batch", "2", "--uneven", "--target-batch", "12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    uneven = [line for line in lines if line.startswith("uneven ")]
    assert len(uneven) == 1 and "(global batch 12)" in uneven[0] and "the split is even" in uneven[0]
    assert any(line.startswith("loss weights     rank 0 x1") for line in lines)


@pytest.mark.parametrize(
    "extra, said",
    [(["--require-batch", "4"], "gate"), (["-q"], "--quiet"), (["--mode", "inference"], "--mode inference")],
)
def test_uneven_where_no_recommendation_is_printed_is_refused(
    extra: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["probe", "batchfit.examples:mlp", *FAST, "--uneven", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchfit: error: --uneven splits") and said in err


# Two real ranks -----------------------------------------------------------------------------------
@pytest.mark.distributed
def test_two_ranks_with_their_own_limits_find_their_own_batches_and_split_unevenly(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "batchfit", "probe", "batchfit.examples:mlp", "--memory-limit-per-rank", "0=40MiB,1=24MiB",
         "--uneven", "--target-batch", "4096", "--timed-steps", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(--memory-limit-per-rank for rank 0)" in done.stdout  # rank 0's header; rank 1 prints nothing
    document = json.loads(out.read_text())
    answers = sorted(document["per_rank"], key=lambda answer: answer["rank"])
    assert [answer["budget_bytes"] for answer in answers] == [40 * 2**20, 24 * 2**20]
    assert answers[0]["safe_batch"] > answers[1]["safe_batch"]
    uneven = [line for line in done.stdout.splitlines() if line.startswith("uneven ")]
    safe = f"({answers[0]['safe_batch']}, {answers[1]['safe_batch']})"
    assert len(uneven) == 1 and "on ranks 0, 1" in uneven[0] and safe in uneven[0]
