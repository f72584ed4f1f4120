"""``find_sharded`` resumed from its trial log, with real ``torchrun`` jobs (``distributed``).

One search of an FSDP2 MLP (every rank keeps ``HOG`` floats per sample through forward, so the
sharded estimate of rank 0 is every rank's and the search takes three jobs) writes the log; then:
a resume reads the estimate and every job from it (no estimate made again, no job); a verdict
flipped to a fit and a line cut off cost one job, not a wrong answer; the memory breakdown comes
from a job that completed its steps, not from the last job, which ran out of memory in step 1;
and once the target's file changes, the old verdicts are not reused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import batchfit
from batchfit.probe import Options
from batchfit.probe.job_runner import JobPerTrial, Opening
from batchfit.probe.job_search import log_key, worker_request
from batchfit.probe.runner import TrialRequest, opened

pytestmark = pytest.mark.distributed

SETTINGS = {"memory_limit": "16MiB", "device": "cpu", "rank_timeout": 30.0, "trial_timeout": 60.0}
TARGET = '''"""An FSDP2 MLP whose every rank keeps HOG floats per sample until the next forward."""

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

HOG = 16384


class Hog(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.held = torch.zeros(x.shape[0], HOG)
        return x


def build() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    first, second = nn.Linear(256, 1024), nn.Linear(1024, 16)
    model = nn.Sequential(first, nn.ReLU(), Hog(), second)
    fully_shard(first)
    fully_shard(second)
    fully_shard(model)
    return model, torch.randn(4, 256)
'''


def jobs(result: batchfit.Result) -> int:
    note = next(n for n in result.notes if "job(s) started" in n)
    return int(note.split("(")[1].split()[0])


def entries(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, batchfit.Result]:
    """The target, its trial log and the answer of a search from the sharded estimate."""
    folder = tmp_path_factory.mktemp("trial_log")
    (folder / "target.py").write_text(TARGET)
    target, log = f"{folder / 'target.py'}:build", folder / "trials.jsonl"
    result = batchfit.find_sharded(target, 2, trial_log=log, **SETTINGS)
    assert result.safe_verified and result.boundary_reached and jobs(result) >= 3
    return target, log, result


def test_a_resume_reads_the_estimate_and_every_job_from_the_log(searched: tuple[str, Path, batchfit.Result]) -> None:
    target, log, first = searched
    logged = log.read_text()
    assert sum(entry.get("kind") == "estimate" for entry in entries(log)) == 1
    again = batchfit.find_sharded(target, 2, trial_log=log, **SETTINGS)
    assert (again.max_batch, again.safe_batch) == (first.max_batch, first.safe_batch) and jobs(again) == 0
    assert any(f"read from the trial log {log}: not made again" in note for note in again.notes)
    assert log.read_text() == logged


def test_a_flipped_verdict_and_a_torn_line_cost_one_job_not_a_wrong_answer(
    searched: tuple[str, Path, batchfit.Result], tmp_path: Path
) -> None:
    """The job above the boundary said "fits" with its out-of-memory still in it, from the one rank
    that answered, and a crash cut the last line: the job runs again, and the answer stays exact."""
    target, log, first = searched
    lines = entries(log)
    above = next(e for e in lines if e.get("batch_size") == first.max_batch + 1 and not e.get("cap_bytes"))
    for verdict in above["ranks"].values():
        verdict["trial"]["fits"] = True
    copy = tmp_path / "trials.jsonl"
    copy.write_text("".join(json.dumps(e) + "\n" for e in lines) + json.dumps(lines[-1])[:200])
    result = batchfit.find_sharded(target, 2, trial_log=copy, **SETTINGS)
    assert (result.max_batch, result.safe_batch) == (first.max_batch, first.safe_batch) and jobs(result) == 1
    assert any("was not used: rank" in note and "names an out-of-memory" in note for note in result.notes)
    assert any("is cut off (a run ended while writing it): skipped" in note for note in result.notes)


def test_the_memory_breakdown_is_a_completed_jobs_not_an_out_of_memory_ones(
    searched: tuple[str, Path, batchfit.Result], tmp_path: Path
) -> None:
    """The last job ran out of memory in step 1's forward: its optimizer state was not made yet. The
    breakdown is the largest fitting job's, whichever job came last."""
    target, log, first = searched
    copy = tmp_path / "trials.jsonl"
    copy.write_text(log.read_text())
    options = Options(memory_limit="16MiB", device="cpu", rank_timeout=30.0)
    fitted = next(e for e in entries(log) if e.get("batch_size") == first.max_batch)["ranks"]["0"]
    verify = next(e for e in entries(log) if e.get("cap_bytes"))
    prober = JobPerTrial(
        worker_request(target, 2, options),
        2,
        options,
        log=copy,
        key=log_key(target, 2, options),
        opening=Opening(first.max_batch),
    )
    with opened(prober):
        fits = prober.run(TrialRequest(first.max_batch))  # the opening job, from the log
        above = prober.run(TrialRequest(first.max_batch + 1))  # from the log
        verified = prober.run(TrialRequest(verify["batch_size"], kind="verify", cap_bytes=verify["cap_bytes"]))
        far = prober.run(TrialRequest(8 * first.max_batch))  # a job: out of memory in step 1
        assert prober.jobs == 1 and not far.fits and far.steps == 0
        model = prober.settle([fits, above, verified, far]).memory
        state = prober.state_bytes()
    assert model is not None
    assert (model.weights_bytes, model.optimizer_state_bytes) == (
        fitted["weights_bytes"],
        fitted["optimizer_state_bytes"],
    )
    assert state == fitted["weights_bytes"] + fitted["trainable_bytes"] + fitted["optimizer_state_bytes"]


class Stop(Exception):
    """The test's end of a search, once its first trial has said what it needed."""


def test_a_changed_target_does_not_reuse_the_old_verdicts(searched: tuple[str, Path, batchfit.Result]) -> None:
    """Four times the floats per sample: the earlier safe batch no longer fits. Its logged verification
    said it did; under the new file's key the first trial is a job of its own, which fails."""
    target, log, first = searched
    path = Path(target.rpartition(":")[0])
    trials: list[batchfit.Trial] = []

    def first_only(trial: batchfit.Trial) -> None:
        trials.append(trial)
        raise Stop

    before = len(entries(log))
    path.write_text(TARGET.replace("HOG = 16384", "HOG = 65536"))
    try:
        with pytest.raises(Stop):
            batchfit.find_sharded(target, 2, trial_log=log, guess=first, callback=first_only, **SETTINGS)
    finally:
        path.write_text(TARGET)
    (trial,) = trials
    assert (trial.batch_size, trial.kind, trial.fits) == (first.safe_batch, "verify", False)
    assert len(entries(log)) == before + 1  # a job ran, and was logged under the new key
