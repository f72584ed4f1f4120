"""``batchfit.find_sharded``: the job-per-trial search from Python, one path with ``--nproc-per-trial``.

Its input is checked before any job (fast tests); the search from a guess is pure logic over an
oracle here (the first trial verifies the guessed safe batch, then the boundary), and real jobs
under ``torchrun`` in the ``distributed`` tests: the command line's answer, resumed from its trial
log with no job; three jobs from a guess that holds; Ctrl-C leaves no process of ours running.
"""

from __future__ import annotations

import _thread
import json
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import processes_naming

import batchfit
from batchfit.cli import main
from batchfit.probe.job_search import FromGuess
from batchfit.search import Attempt, Grid, make_strategy

TESTS = Path(__file__).resolve().parent
FSDP = f"{TESTS / 'fsdp_target.py'}:build"
#: The settings of the distributed tests: the FSDP2 MLP's boundary at 95 per rank (rank 1's Hog decides it).
SETTINGS = {"memory_limit": "16MiB", "device": "cpu", "rank_timeout": 30.0, "trial_timeout": 60.0}
JOB_TIMEOUT_S = 120


# Bad input, named before any job ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "error", "said"),
    [
        ({"target": 3}, TypeError, "target must be a str"),
        ({"target": "mymodels.build"}, ValueError, "target must name a factory as 'package.module:factory'"),
        ({"target": ":build"}, ValueError, "target must name a factory"),
        ({"world_size": 0}, ValueError, "world_size must be a positive int"),
        ({"world_size": 2.0}, TypeError, "world_size must be a positive int"),
        ({"world_size": True}, TypeError, "world_size must be a positive int"),
        ({"guess": 0}, ValueError, "guess must be a positive batch size"),
        ({"guess": 1.5}, TypeError, "guess must be a safe batch per rank"),
        ({"trial_timeout": 0}, ValueError, "trial_timeout must be a positive"),
        ({"trial_timeout": math.inf}, ValueError, "trial_timeout must be a positive, finite"),
        ({"trial_log": 3}, TypeError, "trial_log must be a file path"),
        ({"estimate": "yes"}, TypeError, "estimate must be True or False"),
        ({"headroom": 2}, ValueError, "headroom must be a fraction"),  # find's options, checked by Options
        ({"max_batchs": 8}, TypeError, "unexpected keyword argument 'max_batchs'; did you mean 'max_batch'"),
        ({"callback": 3}, TypeError, "callback must be callable"),
        ({"loss_fn": lambda out, batch: out.sum()}, ValueError, "loss_fn cannot reach the ranks of a job"),
        ({"optimizer": lambda params: torch.optim.SGD(params, lr=0.1)}, ValueError, "optimizer cannot reach"),
        ({"make_batch": lambda size: torch.zeros(size, 4)}, ValueError, "make_batch cannot reach"),
        ({"eval": True}, ValueError, r"eval=True sizes evaluation .* \(drop eval\)"),
        ({"noise_scale": True}, ValueError, r"\(drop noise_scale\)"),
        ({"cache": "answers"}, ValueError, r"job search keeps its jobs in trial_log \(drop cache\)"),
        ({"distributed": True}, ValueError, r"\(drop distributed\)"),
    ],
)
def test_bad_input_is_named_before_any_job(tmp_path: Path, given: dict[str, Any], error: type, said: str) -> None:
    log = tmp_path / "trials.jsonl"
    call = {"target": FSDP, "world_size": 2, "trial_log": log, **SETTINGS, **given}
    with pytest.raises(error, match=said):
        batchfit.find_sharded(call.pop("target"), call.pop("world_size"), **call)
    assert not log.exists()  # a job would have logged its verdicts


def test_the_command_line_names_what_goes_with_nproc_per_trial(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", FSDP, "--guess", "8"]) == 2
    assert "--guess goes with --nproc-per-trial" in capsys.readouterr().err
    assert main(["probe", FSDP, "--no-estimate"]) == 2
    assert "--no-estimate goes with --nproc-per-trial" in capsys.readouterr().err
    # find_sharded's own check, through the one path: before any job, a usage error
    assert main(["probe", FSDP, "--nproc-per-trial", "2", "--eval", "--memory-limit", "16MiB", "-q"]) == 2
    assert "(drop eval)" in capsys.readouterr().err


# The search from a guess, over an oracle ---------------------------------------------------------
def _line_oracle(fixed: int, per_sample: int, budget: int, cap: int, calls: list[tuple[int, str]]) -> Any:
    """Memory ``fixed + per_sample x b``: a search trial fits within ``budget``, a verification within ``cap``."""

    def oracle(size: int, kind: str = "search") -> Attempt:
        calls.append((size, kind))
        peak = fixed + per_sample * size
        return Attempt(size, peak <= (cap if kind == "verify" else budget), peak)

    return oracle


@pytest.mark.parametrize("fixed", [0, 3_000_000, 9_000_000])
@pytest.mark.parametrize("per_sample", [1_000, 61_333, 136_191])
def test_a_guess_that_holds_takes_three_trials_and_finds_the_exact_boundary(fixed: int, per_sample: int) -> None:
    budget, headroom = 16 * 2**20, 0.1
    cap = math.floor(budget * (1 - headroom))
    grid = Grid(init=2, maximum=32768, multiple_of=1)
    boundary = min(grid.top, (budget - fixed) // per_sample)
    safe = (cap - fixed) // per_sample
    for slope, state in ((float(per_sample), 0), (None, fixed)):  # a Result's line; an int and the state's bytes
        calls: list[tuple[int, str]] = []
        plan = FromGuess(safe, slope, lambda state=state: state, True, make_strategy("interpolate"))
        report = plan.search(_line_oracle(fixed, per_sample, budget, cap, calls), grid, should_stop=lambda: False,
                             budget_bytes=budget)  # fmt: skip
        assert report.largest_fit == boundary
        assert calls[0] == (safe, "verify")
        assert len(calls) <= 3, calls


@pytest.mark.parametrize("guess", [1, 40, 200, 5000])
def test_any_guess_finds_the_exact_boundary(guess: int) -> None:
    """A guess too low walks up from its verification; one too high fails it and searches from init_batch."""
    fixed, per_sample, budget = 4_000_000, 100_000, 16 * 2**20
    cap = math.floor(budget * 0.9)
    grid = Grid(init=2, maximum=4096, multiple_of=1)
    for slope in (float(per_sample), None, 3.0 * per_sample):  # right, measured, three times too steep
        calls: list[tuple[int, str]] = []
        safe = max(grid.init, min(grid.top, guess))
        plan = FromGuess(safe, slope, lambda: 1_000_000, True, make_strategy("interpolate"))
        report = plan.search(_line_oracle(fixed, per_sample, budget, cap, calls), grid, should_stop=lambda: False,
                             budget_bytes=budget)  # fmt: skip
        assert report.largest_fit == (budget - fixed) // per_sample, (slope, calls)
        assert report.boundary_reached


# Real jobs ----------------------------------------------------------------------------------------
def _jobs(result: batchfit.Result) -> int:
    note = next(n for n in result.notes if "job(s) started" in n)
    return int(note.split("(")[1].split()[0])


@pytest.fixture(scope="module")
def command_line(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``batchfit probe --nproc-per-trial 2`` from ``init_batch``: its trial log and its JSON answer."""
    folder = tmp_path_factory.mktemp("command_line")
    log, out = folder / "trials.jsonl", folder / "cli.json"
    command = [
        sys.executable, "-m", "batchfit", "probe", FSDP, "--nproc-per-trial", "2", "--memory-limit", "16MiB",
        "--device", "cpu", "--rank-timeout", "30", "--trial-timeout", "60", "--no-estimate",
        "--trial-log", str(log), "--json", str(out), "-q",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return log, json.loads(out.read_text())


@pytest.mark.distributed
def test_find_sharded_gives_the_command_lines_answer_and_resumes_from_its_log_with_no_job(
    command_line: tuple[Path, dict[str, Any]],
) -> None:
    """One path: the Python call reads every job of the command line's search from its trial log
    (the same ranks' command line, the same key), runs none, and answers the same."""
    log, cli = command_line
    logged = log.read_text().splitlines()
    assert any(json.loads(line)["cap_bytes"] for line in logged)  # the verification is logged with its cap
    assert cli["world_size"] == 2 and cli["safe_verified"] and cli["boundary_reached"]
    result = batchfit.find_sharded(FSDP, 2, trial_log=log, estimate=False, **SETTINGS)
    assert (result.max_batch, result.safe_batch, result.world_size) == (cli["max_batch"], cli["safe_batch"], 2)
    assert result.safe_verified and result.boundary_reached
    assert [t.batch_size for t in result.trials] == [t["batch_size"] for t in cli["trials"]]
    assert log.read_text().splitlines() == logged and _jobs(result) == 0  # no job ran
    assert any(f"{len(logged)} trial(s) were reused from the trial log" in note for note in result.notes)


@pytest.mark.distributed
def test_from_a_guess_that_holds_three_jobs_give_the_same_answer(
    command_line: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """The guess is a `Result` (an estimate's, or an earlier answer: here the command line's search
    from init_batch): its safe batch verified by the first job, the boundary by the next two."""
    plain_log, cli = command_line
    plain = batchfit.Result.from_dict(cli)
    guided = batchfit.find_sharded(FSDP, 2, trial_log=tmp_path / "guided.jsonl", guess=plain, **SETTINGS)
    assert (guided.max_batch, guided.safe_batch) == (plain.max_batch, plain.safe_batch)
    assert guided.safe_verified and guided.boundary_reached
    assert _jobs(guided) <= 3 < len(plain_log.read_text().splitlines())
    first = guided.trials[0]
    assert (first.batch_size, first.kind, first.fits) == (plain.safe_batch, "verify", True)
    assert first.cap_bytes == math.floor(16 * 2**20 * 0.9)  # each rank's budget less the headroom




@pytest.fixture
def pythons_ctrl_c() -> Iterator[None]:
    """Python's own SIGINT handler for the test, whatever this process had (a shell's background job
    ignores SIGINT; Ray Train's fit installed its own, and a CI run had it from tests/test_ray.py)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads the processes from /proc")
def test_ctrl_c_kills_the_job_and_leaves_no_process_of_ours(
    tmp_path: Path, pythons_ctrl_c: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C as soon as the first job's ranks exist (before they can write their pid files): the
    call raises KeyboardInterrupt, and no torchrun or rank of ours is left running."""
    target = tmp_path / "ctrl_c_target" / "fsdp_target.py"
    target.parent.mkdir()
    shutil.copy(TESTS / "fsdp_target.py", target)
    jobs = tmp_path / "jobs"  # the jobs' folders, whose requests every process of a job names
    jobs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(jobs))
    token = str(jobs)
    seen: list[str] = []

    def interrupt_once_a_rank_runs() -> None:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline and not seen:
            lines = processes_naming(token).values()
            seen.extend(line for line in lines if "batchfit.worker" in line and "distributed.run" not in line)
            time.sleep(0.01)
        _thread.interrupt_main()

    watcher = threading.Thread(target=interrupt_once_a_rank_runs, daemon=True)
    watcher.start()
    with pytest.raises(KeyboardInterrupt):
        batchfit.find_sharded(f"{target}:build", 2, estimate=False, **SETTINGS)
        time.sleep(JOB_TIMEOUT_S)  # the answer came first: wait for the interrupt, then fail below
    watcher.join()
    assert seen, "no rank was seen running"
    deadline = time.monotonic() + 10
    while processes_naming(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_naming(token)
