"""The trial log of ``find_sharded`` read with the result cache's guards (``batchfit.probe.cache_files``).

A log that is not a regular file (a FIFO would block, a link to ``/dev/zero`` never ends), a line
that is not a trial log's, an entry without its fields: a clear error naming the file, before any
job. A line a crash cut off is skipped with a note, and the rest is used. A job's verdicts are
reused only when every rank's agrees with itself (a fit names no out-of-memory and peaked within
its limit) and a fit is every rank's. The key holds what identifies the target's file and the
device. Fast: no job starts (the end-to-end resume is ``tests/test_trial_log_resume.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import batchfit
from batchfit.probe import Options
from batchfit.probe.cache_files import TRIAL_LOG_SCHEMA, append_line, read_trial_log
from batchfit.probe.job_runner import JobPerTrial
from batchfit.probe.job_search import log_key
from batchfit.report import Trial

TESTS = Path(__file__).resolve().parent
FSDP = f"{TESTS / 'fsdp_target.py'}:build"
SETTINGS = {"memory_limit": "16MiB", "device": "cpu", "rank_timeout": 30.0, "trial_timeout": 60.0}
BUDGET = 16 * 2**20
KEY = {"target": "t.py:build", "nproc": 2}
#: What a rank of the FSDP2 MLP said at batch 95 (fits) and rank 1 at 96 (out of memory in forward).
FIT = Trial(95, True, peak_bytes=16_725_088, steps=2)
OOM = Trial(96, False, phase="forward", peak_bytes=16_861_280, steps=1, message="OutOfMemoryError: CPU out of memory")


def verdict(trial: Trial, **changed: Any) -> dict[str, Any]:
    """A rank's verdict as `batchfit.probe.job_runner.run_worker_trial` writes it."""
    return {
        "trial": {**dataclasses.asdict(trial), **changed},
        "budget_bytes": BUDGET,
        "cap_bytes": None,
        "counts": "allocated",
        "device": {"type": "cpu", "index": None, "name": "CPU", "total_bytes": 2**34, "config": []},
        "limit_bytes": BUDGET,
        "limit_source": "memory_limit",
        "reserve_bytes": 0,
        "weights_bytes": 559_136,
        "trainable_bytes": 559_136,
        "optimizer_state_bytes": 1_118_272,
        "fixed_advice": None,
    }


def line(batch_size: int, ranks: dict[str, dict[str, Any]], key: dict[str, Any] = KEY) -> str:
    """A job's line as `JobPerTrial` appends it."""
    entry = {"schema": TRIAL_LOG_SCHEMA, "key": key, "batch_size": batch_size, "steps": 2, "cap_bytes": None,
             "headroom": None, "ranks": ranks}  # fmt: skip
    return json.dumps(entry, sort_keys=True)


def both_fit(size: int = 95) -> dict[str, dict[str, Any]]:
    fit = dataclasses.replace(FIT, batch_size=size)
    return {"0": verdict(fit), "1": verdict(fit)}


# Not a trial log: named, before any job ---------------------------------------------------------
@contextlib.contextmanager
def address_space_capped(extra: int = 2**30) -> Iterator[None]:
    """At most ``extra`` more bytes of address space inside: a read without limit ends in MemoryError."""
    size = int(next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmSize")).split()[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size * 1024 + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def fifo_unblocked_after(path: Path, seconds: float) -> Iterator[None]:
    """A reader blocked on the FIFO ``path`` gets a line that is no log's after ``seconds``."""
    done = threading.Event()

    def unblock() -> None:
        if not done.wait(seconds):
            with contextlib.suppress(OSError):
                descriptor = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                os.write(descriptor, b"blocked\n")
                os.close(descriptor)

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="a FIFO, /dev/zero and /proc: Linux")
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "directory"])
def test_a_log_that_is_not_a_regular_file_is_refused_before_any_job(tmp_path: Path, kind: str) -> None:
    log = tmp_path / "trials.jsonl"
    if kind == "fifo":
        os.mkfifo(log)
    elif kind == "directory":
        log.mkdir()
    else:
        log.symlink_to("/dev/zero")
    with address_space_capped(), fifo_unblocked_after(log, 10.0) if kind == "fifo" else contextlib.nullcontext():
        with pytest.raises(ValueError, match=f"the trial log {log} cannot be read: it is not a regular file"):
            batchfit.find_sharded(FSDP, 2, trial_log=log, estimate=False, **SETTINGS)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            json.dumps({"schema": TRIAL_LOG_SCHEMA, "batch_size": 4, "steps": 2, "ranks": {}}),
            "line 1 is not whole: it has no 'key'",
        ),
        ('["a list"]', f"line 1 is not a '{TRIAL_LOG_SCHEMA}' entry"),
        ("batch,fits\n4,yes", "line 1 is not JSON"),
    ],
    ids=["no key", "not an entry", "a CSV"],
)
def test_a_line_that_is_no_trial_logs_is_an_error_naming_the_file(tmp_path: Path, text: str, said: str) -> None:
    log = tmp_path / "trials.jsonl"
    log.write_text(text + "\n")
    with pytest.raises(ValueError, match=f"the trial log {log} is not a batchfit trial log: {said}"):
        batchfit.find_sharded(FSDP, 2, trial_log=log, estimate=False, **SETTINGS)
    assert log.read_text() == text + "\n"  # no job appended to somebody else's file


def test_a_verdict_without_its_trial_is_an_error_naming_the_file(tmp_path: Path) -> None:
    log = tmp_path / "trials.jsonl"
    ranks = both_fit()
    del ranks["1"]["trial"]
    log.write_text(line(95, ranks) + "\n")
    with pytest.raises(ValueError, match=f"{log} is not a batchfit trial log: line 1 is not whole: rank 1's verdict"):
        read_trial_log(log, KEY, 2)


# A line a crash cut off -----------------------------------------------------------------------------
def test_a_torn_last_line_is_skipped_with_a_note_and_the_rest_is_used(tmp_path: Path) -> None:
    """A run killed while it appended: the lines before are whole, and a resume uses them."""
    log = tmp_path / "trials.jsonl"
    whole = line(4, both_fit(4)) + "\n" + line(95, both_fit()) + "\n"
    log.write_text(whole + line(96, {"1": verdict(OOM)})[:300])
    options = Options(memory_limit="16MiB", device="cpu")
    prober = JobPerTrial(["t.py:build"], 2, options, log=log, key=KEY)  # reads the log; no job until entered
    assert prober.notes == [f"line 3 of the trial log {log} is cut off (a run ended while writing it): skipped"]
    assert [entry["batch_size"] for entry in read_trial_log(log, KEY, 2).jobs] == [4, 95]
    append_line(log, line(96, {"1": verdict(OOM)}))  # the next job's line stands alone
    logged = read_trial_log(log, KEY, 2)
    assert [entry["batch_size"] for entry in logged.jobs] == [4, 95, 96]
    assert logged.notes == (f"line 3 of the trial log {log} is cut off (a run ended while writing it): skipped",)


# Verdicts that contradict themselves --------------------------------------------------------------
@pytest.mark.parametrize(
    ("ranks", "said"),
    [
        ({"1": verdict(OOM, fits=True)}, "rank 1's verdict says it fits, and names an out-of-memory (in forward"),
        ({"1": verdict(OOM, fits=True, phase=None, message=None)}, "rank 1's verdict says it fits, with a peak of"),
        (
            {"1": verdict(OOM, fits=True, phase=None, message=None, peak_bytes=9_000_000)},
            "it says the job fitted, and rank(s) 0 gave no verdict",
        ),
        (
            {"0": verdict(FIT, batch_size=96), "1": verdict(OOM, message=None)},
            "says it ran out of memory, and names no",
        ),
        ({"0": verdict(FIT), "1": verdict(FIT)}, "rank 0's verdict is of batch size 95, not the job's 96"),
        ({"0": verdict(FIT, batch_size=96), "2": verdict(FIT, batch_size=96)}, "rank '2', not one of the 2 ranks"),
        ({"0": verdict(FIT, batch_size=96, peak_bytes="many")}, "rank 0's verdict is refused"),
    ],
    ids=[
        "flipped",
        "flipped, no message",
        "flipped, one rank of two",
        "no error",
        "another size",
        "rank 2",
        "bad peak",
    ],
)
def test_a_verdict_that_contradicts_itself_is_not_reused(tmp_path: Path, ranks: dict[str, Any], said: str) -> None:
    log = tmp_path / "trials.jsonl"
    log.write_text(line(95, both_fit()) + "\n" + line(96, ranks) + "\n")
    logged = read_trial_log(log, KEY, 2)
    assert [entry["batch_size"] for entry in logged.jobs] == [95]
    assert len(logged.notes) == 1 and logged.notes[0].startswith(f"line 2 of the trial log {log} was not used: ")
    assert said in logged.notes[0]


def test_a_failure_from_one_rank_and_another_searchs_lines_are_read_as_they_are(tmp_path: Path) -> None:
    """A job ends at its first failure: one rank's out-of-memory is the job's. Another key's lines
    (another target, device, ranks) are this search's to skip, without a note."""
    log = tmp_path / "trials.jsonl"
    other = {**KEY, "nproc": 4}
    log.write_text(line(96, {"1": verdict(OOM)}) + "\n" + line(96, {"3": verdict(OOM, fits=True)}, other) + "\n")
    logged = read_trial_log(log, KEY, 2)
    assert [entry["ranks"]["1"]["trial"]["fits"] for entry in logged.jobs] == [False] and not logged.notes


def test_a_message_is_made_printable_before_it_can_be_shown(tmp_path: Path) -> None:
    log = tmp_path / "trials.jsonl"
    log.write_text(line(96, {"1": verdict(OOM, message="OutOfMemoryError\x1b[2J")}) + "\n")
    (entry,) = read_trial_log(log, KEY, 2).jobs
    assert entry["ranks"]["1"]["trial"]["message"] == "OutOfMemoryError\\x1b[2J"


# The key -----------------------------------------------------------------------------------------
def test_the_key_holds_the_target_files_contents_and_the_device(tmp_path: Path) -> None:
    """Two targets of one name whose files differ key apart; so does a file edited in place."""
    target = tmp_path / "target.py"
    target.write_text((TESTS / "fsdp_target.py").read_text())
    options = Options(memory_limit="16MiB", device="cpu")
    before = log_key(f"{target}:build", 2, options)
    target.write_text(target.read_text().replace("16384", "65536"))
    after = log_key(f"{target}:build", 2, options)
    assert before != after and before["target_file"]["path"] == after["target_file"]["path"] == str(target)
    assert before["device"]["type"] == "cpu" and before["device"]["total_bytes"]
    module = log_key("fsdp_target:build", 2, options)  # found on sys.path (tests/conftest.py), not imported
    assert module["target_file"]["path"] == str(TESTS / "fsdp_target.py") and module["target_file"]["sha256"]
