"""Many ranks: two real processes (gloo on the CPU) probing real models together.

``tests/ranks_job.py`` runs every two-rank scenario in one spawned job (starting processes and
importing torch is most of the cost); the tests here read what each rank wrote. Every
subprocess runs under a timeout, so a hang fails the test instead of hanging CI.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import batchfit
from batchfit.distributed import combine_trials, from_environment
from batchfit.errors import NothingFitsError, RankFailedError, RanksTimeoutError, annotate
from batchfit.examples import gpt
from batchfit.report import Trial

TESTS = Path(__file__).parent
JOB_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What rank 0 and rank 1 saw in ``ranks_job.py``."""
    out = tmp_path_factory.mktemp("ranks")
    done = subprocess.run(
        [sys.executable, str(TESTS / "ranks_job.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, record in enumerate(records):
        assert "crash" not in record, f"rank {rank}:\n{record['crash']}"
    return records


@pytest.mark.distributed
def test_different_limits_agree_on_the_smaller_single_process_answer(ranks: list[dict[str, Any]]) -> None:
    together = [r["limits"]["together"] for r in ranks]
    alone = [r["limits"]["alone"] for r in ranks]
    assert together[0] == {**together[1], "seconds": together[0]["seconds"]}  # same answer, same trials
    smaller = min(alone, key=lambda a: a["budget_bytes"])
    assert alone[0]["max_batch"] > alone[1]["max_batch"]  # the limits really differ in what fits
    assert together[0]["max_batch"] == smaller["max_batch"]
    assert together[0]["safe_batch"] == smaller["safe_batch"]
    assert together[0]["budget_bytes"] == smaller["budget_bytes"] + ranks[0]["limits"]["buckets"]
    assert together[0]["world_size"] == 2
    assert not any("gradient_as_bucket_view" in note for note in ranks[0]["limits"]["notes"])  # default DDP
    # The boundary failed on rank 1 only (rank 0's limit holds it): the group still calls it a failure.
    failed = [batch for batch, fits, _, _ in together[0]["trials"] if not fits]
    assert failed and all(batch <= alone[0]["max_batch"] for batch in failed)


@pytest.mark.distributed
def test_every_rank_gets_its_model_and_optimizer_back_and_ddp_trains_after(ranks: list[dict[str, Any]]) -> None:
    for scenario in ("limits", "phase_forward", "phase_backward", "phase_step", "error", "interrupt"):
        for rank, record in enumerate(ranks):
            assert record[scenario]["restored"] == [], (
                f"{scenario} on rank {rank}: differs in {record[scenario]['restored']}"
            )
        # A real DDP step afterwards: it ran on both ranks, and DDP synchronised the gradients.
        assert ranks[0][scenario]["checksum_after_step"] == ranks[1][scenario]["checksum_after_step"], scenario


@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["forward", "backward", "step"])
def test_an_oom_on_one_rank_fails_the_trial_on_both(ranks: list[dict[str, Any]], phase: str) -> None:
    peaks = ranks[1]["phase_peaks"]
    assert peaks["batch"] < peaks["forward"] < peaks["backward"] < peaks["step"]  # each phase can be hit alone
    for rank in (0, 1):
        trial = ranks[rank][f"phase_{phase}"]
        assert trial["fits"] is False
        assert trial["phase"] == phase
        assert trial["message"].startswith("rank 1: OutOfMemoryError")


@pytest.mark.distributed
def test_an_error_on_rank_1_raises_on_both_naming_it(ranks: list[dict[str, Any]]) -> None:
    seen0, seen1 = ranks[0]["error"]["raised"], ranks[1]["error"]["raised"]
    assert seen1["type"] == "ValueError" and seen1["message"] == "boom at batch 8"
    assert seen0["type"] == "RankFailedError"
    assert (seen0["rank"], seen0["batch_size"]) == (1, 8)
    assert "rank 1" in seen0["message"] and "batch size 8" in seen0["message"]
    assert "ValueError: boom at batch 8" in seen0["message"]


@pytest.mark.distributed
def test_ctrl_c_on_one_rank_stops_both(ranks: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        record = ranks[rank]["interrupt"]
        assert record["raised"]["type"] == "KeyboardInterrupt"
        assert record["trials"] == ranks[0]["interrupt"]["trials"]  # both stopped at the same meeting
    assert len(ranks[0]["interrupt"]["trials"]) == 1


@pytest.mark.distributed
def test_a_rank_that_never_calls_find_is_an_error_within_the_timeout(ranks: list[dict[str, Any]]) -> None:
    absent = ranks[0]["absent"]
    assert absent["raised"]["type"] == "RanksTimeoutError"
    assert "not every rank" in absent["raised"]["message"]
    assert absent["seconds"] < 30  # the 3 s timeout, not gloo's 30 minutes


@pytest.mark.distributed
def test_gradient_as_bucket_view_says_the_answer_is_conservative(ranks: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        record = ranks[rank]["bucket_view"]
        assert record["max_batch"] == 64  # nothing ran out of memory: the note is about the setting
        assert any("gradient_as_bucket_view=True" in note for note in record["notes"])


@pytest.mark.distributed
def test_ranks_that_search_differently_are_refused(ranks: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        raised = ranks[rank]["settings"]["raised"]
        assert raised["type"] == "ValueError" and "max_batch=" in raised["message"]


@pytest.mark.distributed
def test_models_with_collectives_inside_forward_are_refused_not_hung(ranks: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        raised = ranks[rank]["sync_batchnorm"]["raised"]
        assert raised["type"] == "NotImplementedError" and "SyncBatchNorm" in raised["message"]
        raised = ranks[rank]["fsdp"]["raised"]
        assert raised["type"] == "NotImplementedError" and "FSDPModule" in raised["message"]
        assert "--nproc-per-trial" in raised["message"]  # where to go instead


@pytest.mark.distributed
def test_torchrun_probe_writes_one_json_with_the_single_process_answer(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "batchfit", "probe", "batchfit.examples:gpt", "--memory-limit", "64MiB", "--json", str(out)],
        capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["world_size"] == 2
    assert done.stdout.count("probing batchfit.examples:gpt") == 1  # only rank 0 printed
    assert "global max batch" in done.stdout
    assert "wrapped in DistributedDataParallel" in done.stdout
    model, sample = gpt()
    buckets = sum(p.numel() * p.element_size() for p in model.parameters())  # a DDP rank's gradient buckets
    alone = batchfit.find(model, sample, memory_limit=64 * 2**20 - buckets)
    assert document["max_batch"] == alone.max_batch


@pytest.mark.distributed
def test_ctrl_c_on_torchrun_ends_every_rank_restored(tmp_path: Path) -> None:
    """torchrun forwards SIGINT to every rank: each restores its model and exits 130."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "batchfit", "probe", "batchfit.examples:gpt", "--memory-limit", "400MiB", "--strategy", "binary"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:  # rank 0's rows; interrupt once the first trial is in
            if line.split()[:1] == ["1"]:
                launcher.send_signal(signal.SIGINT)
                break
        _, stderr = launcher.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        launcher.kill()
    assert stderr.count("batchfit: error: interrupted (the model and optimizer were restored)") == 2, stderr[-3000:]


@pytest.mark.distributed
def test_fsdp_runs_a_job_per_trial_and_a_rank_that_ooms_alone_ends_it(tmp_path: Path) -> None:
    """FSDP2 with rank 1 out of memory in forward while rank 0 walks into the next all-gather:
    the driver decides on rank 1's verdict and kills the job (no hang, well inside the timeout);
    a rerun with the same trial log runs no job at all."""
    log, out = tmp_path / "trials.jsonl", tmp_path / "fsdp.json"
    command = [
        sys.executable, "-m", "batchfit", "probe", str(TESTS / "fsdp_target.py") + ":build", "--nproc-per-trial", "2",
        "--memory-limit", "16MiB", "--init-batch", "64", "--multiple-of", "64", "--max-batch", "128",
        "--verify-steps", "0", "--trial-timeout", "60", "--trial-log", str(log), "--json", str(out), "-q",
        "--no-estimate",  # the jobs from init_batch: rank 1's Hog is no part of rank 0's estimate
    ]  # fmt: skip
    first = subprocess.run(command, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["max_batch"], result["world_size"], result["boundary_reached"]) == (64, 2, True)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [entry["batch_size"] for entry in entries] == [64, 128]
    assert set(entries[0]["ranks"]) == {"0", "1"}  # both answered: 64 fits everywhere
    assert set(entries[1]["ranks"]) == {"1"}  # rank 0 was inside a collective when the job was killed
    assert "rank 1: OutOfMemoryError" in result["trials"][1]["message"]
    out.unlink()
    again = subprocess.run(command, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(out.read_text())["max_batch"] == 64
    assert len(log.read_text().splitlines()) == 2  # resumed from the log: no new job
    assert any("reused from the trial log" in note for note in json.loads(out.read_text())["notes"])


#: A job of two gloo ranks whose rank 1 fails a collective in forward at batch 16 and above with
#: the DistBackendError that ProcessGroupNCCL raises (C10D_NCCL_CHECK, NCCLUtils.hpp), one search
#: per "Last error" below. Written out by the test: only the message is made up, not the ranks.
NCCL_JOB = """
import datetime, json, sys
from pathlib import Path
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import batchfit

LAST_ERRORS = json.loads(sys.argv[2])

class NcclFailsAt16(nn.Module):
    def __init__(self, last_error):
        super().__init__()
        self.net, self.last_error = nn.Linear(8, 4), last_error

    def forward(self, x):
        if dist.get_rank() == 1 and x.shape[0] >= 16:
            raise dist.DistBackendError(
                "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:133, unhandled cuda error "
                "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\\nncclUnhandledCudaError: Call to "
                "CUDA function failed.\\nLast error:\\n" + self.last_error
            )
        return self.net(x)

def run(rank, out):
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    records = []
    for last_error in LAST_ERRORS:
        torch.manual_seed(0)
        model = DistributedDataParallel(NcclFailsAt16(last_error))
        try:
            result = batchfit.find(model, torch.randn(4, 8), strategy="binary", max_batch=64, verify_steps=0,
                                   rank_timeout=20.0)
        except Exception as exc:
            records.append({"raised": type(exc).__name__, "message": str(exc)})
        else:
            failed = [[t.batch_size, t.phase, t.message] for t in result.trials if not t.fits]
            records.append({"max_batch": result.max_batch, "failed": failed})
    Path(out, f"rank{rank}.json").write_text(json.dumps(records))

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=2, join=True)
"""


@pytest.mark.distributed
def test_nccls_out_of_memory_in_a_collective_fails_the_trial_not_the_probe(tmp_path: Path) -> None:
    """NCCL out of device memory for its buffers (runtime API, or its calloc's own warning) is rank
    1's out-of-memory: a failed trial on both ranks (PeerOutOfMemory on rank 0), the search goes
    on below it. NCCL's other failures stay errors: RankFailedError on rank 0, the error on rank 1."""
    last_errors = [
        "Cuda failure 'out of memory'",
        "Failed to CUDA calloc async 4 bytes",
        "Cuda failure 'an illegal memory access was encountered'",
        "Cuda failure 'invalid argument'",
    ]
    (tmp_path / "job.py").write_text(NCCL_JOB)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "job.py"), str(tmp_path), json.dumps(last_errors)],
        capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for oom in (0, 1):
        for rank in (0, 1):
            record = ranks[rank][oom]
            assert record.get("max_batch") == 15, record  # the search went on below rank 1's failure
            assert [(batch, phase) for batch, phase, _ in record["failed"]] == [(16, "forward")]
            message = record["failed"][0][2]
            assert message.startswith("rank 1: DistBackendError: NCCL error in:")
            assert message.endswith(f"({last_errors[oom]})")  # why it counted as an out-of-memory
    for case in (2, 3):
        assert ranks[0][case]["raised"] == "RankFailedError", ranks[0][case]
        assert "rank 1" in ranks[0][case]["message"] and "batch size 16" in ranks[0][case]["message"]
        assert ranks[0][case]["message"].endswith(f"({last_errors[case]})")  # NCCL's reason, not only its call
    assert ranks[1][2]["raised"] == "DeviceFailedError"  # sticky: the context is gone
    assert ranks[1][3]["raised"] == "DistBackendError"  # propagated as it was


# One process --------------------------------------------------------------------------------------
def _trial(**fields: Any) -> Trial:
    return Trial(**{"batch_size": 8, "fits": True, "steps": 1, **fields})


def test_combined_trial_takes_the_worst_rank() -> None:
    fast = _trial(peak_bytes=100, phase_peaks=(("forward", 60), ("backward", 100)), step_time_s=0.1,
                  samples_per_s=80.0, step_times_s=(0.1, 0.12))  # fmt: skip
    slow = _trial(peak_bytes=90, phase_peaks=(("forward", 70), ("backward", 90)), step_time_s=0.2,
                  samples_per_s=40.0, step_times_s=(0.2, 0.1))  # fmt: skip
    both = combine_trials([fast, slow])
    assert both.fits and both.peak_bytes == 100
    assert both.phase_peaks == (("forward", 70), ("backward", 100))
    assert both.step_time_s == 0.2 and both.step_times_s == (0.2, 0.12)
    assert both.samples_per_s == pytest.approx(2 * 8 / 0.2)  # the group's rate, at the slowest rank's step


def test_combined_trial_fails_where_one_rank_failed_and_keeps_the_largest_bound() -> None:
    fitted = _trial(peak_bytes=500, phase_peaks=(("forward", 300), ("backward", 500)), step_time_s=0.1)
    failed = _trial(fits=False, phase="backward", peak_bytes=420, phase_peaks=(("forward", 300),),
                    message="OutOfMemoryError: no")  # fmt: skip
    both = combine_trials([fitted, failed], out_of_memory=(1, "OutOfMemoryError: no"))
    assert not both.fits and both.phase == "backward"
    assert both.peak_bytes == 500  # rank 0 measured the whole size: at least that is needed
    assert both.message == "rank 1: OutOfMemoryError: no"
    assert both.samples_per_s is None and both.step_times_s == ()


@pytest.mark.parametrize(
    "error",
    [
        RankFailedError(1, 8, "forward", "ValueError: boom at batch 8"),
        RankFailedError(0, None, "joining", "RuntimeError: no"),
        NothingFitsError(2, 1000, 500, "backward", "OutOfMemoryError: no", "Lower init_batch."),
        RanksTimeoutError("rank 0: not every rank answered"),
    ],
)
def test_batchfit_errors_cross_process_boundaries_unchanged(error: Exception) -> None:
    """A worker's error reaches the driver pickled (Ray Train, multiprocessing): the default
    rebuild calls ``__init__`` with the message alone, which fails for ``RankFailedError``."""
    annotate(error, "batchfit: raised during forward of a trial at batch size 8")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert (str(copy), copy.args, copy.__dict__) == (str(error), error.args, error.__dict__)


def test_distributed_true_needs_a_process_group() -> None:
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="init_process_group"):
        batchfit.find(model, torch.randn(2, 4), distributed=True)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "10"])
def test_rank_timeout_must_be_positive_seconds(bad: Any) -> None:
    with pytest.raises(ValueError, match="rank_timeout"):
        batchfit.Options(rank_timeout=bad)


def test_distributed_must_be_a_bool_or_none() -> None:
    with pytest.raises(TypeError, match="distributed"):
        batchfit.Options(distributed="yes")  # type: ignore[arg-type]


def test_torchrun_environment_is_read_and_a_job_of_one_probes_alone() -> None:
    launch = from_environment({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"})
    assert launch is not None and (launch.rank, launch.local_rank, launch.world_size) == (3, 1, 4)
    assert not launch.is_leader
    assert launch.device_for("cuda") == "cuda:1" and launch.device_for("cuda:0") == "cuda:0"
    assert launch.device_for("cpu") == "cpu"
    assert from_environment({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}) is None
    assert from_environment({}) is None


def test_a_job_without_local_rank_takes_srun_s_or_is_refused() -> None:
    """srun sets RANK-like variables but ``SLURM_LOCALID``, not ``LOCAL_RANK``: such a rank used to
    probe alone, silently (issue 32); now its local rank is read, or the job is refused by name."""
    launch = from_environment({"RANK": "5", "WORLD_SIZE": "8", "SLURM_LOCALID": "1"})
    assert launch is not None and (launch.rank, launch.local_rank, launch.world_size) == (5, 1, 8)
    with pytest.raises(ValueError, match=r"RANK=5 and WORLD_SIZE=8 are set but no local rank.*LOCAL_RANK="):
        from_environment({"RANK": "5", "WORLD_SIZE": "8"})


#: Two gloo ranks, each started as its own process (a rank killed under ``mp.spawn`` takes its
#: peers down with it): rank 1 is killed (SIGKILL) in forward at batch 8, rank 0 writes what it got.
KILLED_JOB = """
import datetime, json, os, signal, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import batchfit

class KilledAt8(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 4)

    def forward(self, x):
        if dist.get_rank() == 1 and x.shape[0] >= 8:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)

rank, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
torch.set_num_threads(1)
try:
    batchfit.find(DistributedDataParallel(KilledAt8()), torch.randn(4, 8), strategy="binary", max_batch=64,
                  verify_steps=0, rank_timeout=60.0)
except Exception as exc:
    Path(out, "survivor.json").write_text(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
"""


@pytest.mark.distributed
def test_a_rank_killed_mid_probe_is_named_as_gone_not_as_a_timeout(tmp_path: Path) -> None:
    """gloo tells the survivor at once that its peer's connection closed: the error says that rank
    1 went away, where and when, not that the ranks ran out of their 60 s."""
    (tmp_path / "job.py").write_text(KILLED_JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(tmp_path / "job.py")]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    ranks = [subprocess.Popen([*command, str(rank), str(tmp_path)], **pipes) for rank in (0, 1)]
    try:
        (_, survivor_err), _ = (rank.communicate(timeout=JOB_TIMEOUT_S) for rank in ranks)
    finally:
        for rank in ranks:
            rank.kill()
    assert ranks[1].returncode == -signal.SIGKILL
    assert ranks[0].returncode == 0, survivor_err[-3000:]
    raised = json.loads((tmp_path / "survivor.json").read_text())
    assert raised["type"] == "RanksTimeoutError"
    assert raised["message"].startswith("rank 0: rank 1 went away during forward at batch size 8, at "), raised
    assert re.search(r", at \d\d:\d\d:\d\d UTC, \d+\.\d s into the meeting:", raised["message"]), raised
    assert "it exited, crashed or was killed" in raised["message"]
    assert "within 60 s" not in raised["message"]


@pytest.mark.distributed
def test_a_rank_that_cannot_make_the_gradient_bucket_fails_the_trial_before_the_all_reduce(tmp_path: Path) -> None:
    """Rank 1 holds the step's gradients but not the buffer DDP's buckets are all-reduced through
    (``tests/bucket_job.py``): the ranks agree on that before rank 0 enters the all-reduce, so the
    trial is rank 1's out-of-memory at the step on both ranks and the search goes on, where rank 0
    used to wait in the all-reduce until the rank timeout (20 s) ended the probe on both."""
    done = subprocess.run(
        [sys.executable, str(TESTS / "bucket_job.py"), str(tmp_path)], capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, record in enumerate(records):
        assert "crash" not in record, f"rank {rank}:\n{record['crash']}"
    result = records[0]["result"]
    assert records[1]["result"] == result
    bucket = f"you tried to allocate {records[0]['bucket_bytes']} bytes"  # the whole bucket, nothing else
    failed = [(batch, phase, message) for batch, fits, phase, message in result["trials"] if not fits]
    assert failed, result["trials"]
    for _, phase, message in failed:
        assert phase == "step" and message.startswith("rank 1: OutOfMemoryError") and bucket in message, message
    assert 1 <= result["safe_batch"] <= result["max_batch"] < min(batch for batch, _, _ in failed)
    assert result["per_rank"][1][1] == result["max_batch"] < result["per_rank"][0][1]  # rank 1's limit, not rank 0's
