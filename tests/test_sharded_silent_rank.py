"""A rank of a trial job that stops responding is the one named (issue 48): with rank 1 SIGSTOPped,
``find_sharded`` said "rank 0 failed ... could not join", blaming the rank that waited for it."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

import batchfit
from batchfit.errors import RanksTimeoutError

TESTS = Path(__file__).resolve().parent
WATCH_S = 120


def _rank_1_of(token: str) -> tuple[int, str] | None:
    """The pid and trial folder of rank 1 of a job whose folder is under ``token``, once it runs."""
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = [word for word in path.read_bytes().decode(errors="replace").split("\0") if word]
            environ = (path.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if token in " ".join(words) and "batchfit.worker" in words and "torch.distributed.run" not in words:
            if b"LOCAL_RANK=1" in environ:
                return int(path.parent.name), str(Path(words[-1]).parent)  # the request is in the trial folder
    return None


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads the processes from /proc")
@pytest.mark.parametrize("when", ["joining", "in the trial"])
def test_a_stopped_rank_is_named_not_the_rank_that_waited_for_it(
    tmp_path: Path, when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "silent" / "fsdp_target.py"
    target.parent.mkdir()
    shutil.copy(TESTS / "fsdp_target.py", target)
    jobs = tmp_path / "jobs"  # the jobs' folders: a path no other process names
    jobs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(jobs))
    stopped: list[int] = []

    def stop_rank_1() -> None:
        deadline = time.monotonic() + WATCH_S
        while time.monotonic() < deadline:
            found = _rank_1_of(str(jobs))
            if found is not None:
                pid, folder = found
                while when == "in the trial" and not (Path(folder) / "rank1.pid").exists():
                    time.sleep(0.001)  # it joined the group and started its trial
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=stop_rank_1, daemon=True)
    watcher.start()
    try:
        with pytest.raises(RanksTimeoutError) as raised:
            batchfit.find_sharded(
                f"{target}:build", 2, estimate=False, memory_limit="16MiB", device="cpu", rank_timeout=10.0,
                trial_timeout=120.0,
            )  # fmt: skip
    finally:
        watcher.join()
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert stopped, "rank 1 was never seen running"
    said = str(raised.value)
    assert "rank(s) 1 gave no answer" in said and "rank(s) 0 waited for them" in said, said
    assert not said.startswith("rank 0 failed"), said
