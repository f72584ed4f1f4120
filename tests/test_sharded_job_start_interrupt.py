"""Ctrl-C while ``Popen`` starts a trial's torchrun job (issue 48): the job's handle was never
stored, so nothing killed it and torchrun and both ranks ran their trial to the end. A real SIGINT is
delivered at chosen points of the start (``sys.settrace``, as ``tests/test_interrupts.py`` does), in
a child process of its own; afterwards no process of the job may be running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import processes_naming

TESTS = Path(__file__).resolve().parent
JOB_TIMEOUT_S = 180

#: The driver, interrupted by a real SIGINT where ``argv[2]`` says, once ``Popen`` starts torchrun:
#: ``exec``: at the line where ``Popen`` waits for the child's exec (the child exists, ``Popen``
#: has not returned); ``returned``: as ``Popen.__init__`` returns (its handle not yet stored).
DRIVER = r"""
import inspect, signal, subprocess, sys
import batchfit

target, where = sys.argv[1], sys.argv[2]
source, first = inspect.getsourcelines(subprocess.Popen._execute_child)
exec_line = first + next(i for i, text in enumerate(source) if "os.read(errpipe_read" in text)
fired = []

def local(frame, event, arg):
    if fired:
        return None
    code = frame.f_code
    hit = (where == "exec" and event == "line" and code is subprocess.Popen._execute_child.__code__
           and frame.f_lineno == exec_line)
    hit = hit or (where == "returned" and event == "return" and code is subprocess.Popen.__init__.__code__)
    if hit:
        fired.append(event)
        sys.settrace(None)
        signal.raise_signal(signal.SIGINT)
    return local

def tracer(frame, event, arg):
    code = frame.f_code
    if code is subprocess.Popen.__init__.__code__:
        args = frame.f_locals.get("args")
        if isinstance(args, (list, tuple)) and "torch.distributed.run" in args:
            return local
    if code is subprocess.Popen._execute_child.__code__:
        args = frame.f_locals.get("args")
        if isinstance(args, (list, tuple)) and "torch.distributed.run" in args:
            return local
    return None

signal.signal(signal.SIGINT, signal.default_int_handler)
sys.settrace(tracer)
try:
    batchfit.find_sharded(target, 2, estimate=False, memory_limit="16MiB", device="cpu", rank_timeout=30.0,
                          trial_timeout=60.0)
except KeyboardInterrupt:
    sys.settrace(None)
    print("interrupted", fired, flush=True)
    sys.exit(130)
sys.settrace(None)
print("not interrupted", fired, flush=True)
"""




@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads the processes from /proc")
@pytest.mark.parametrize("where", ["exec", "returned"])
def test_ctrl_c_while_popen_starts_the_job_leaves_no_process_running(tmp_path: Path, where: str) -> None:
    target = tmp_path / "start_target" / "fsdp_target.py"  # a path no other process names
    target.parent.mkdir()
    shutil.copy(TESTS / "fsdp_target.py", target)
    jobs = tmp_path / "jobs"  # the jobs' folders, whose requests every process of a job names
    jobs.mkdir()
    token = str(jobs)
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, f"{target}:build", where],
        capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env={**os.environ, "TMPDIR": token},
    )  # fmt: skip
    try:
        assert done.returncode == 130 and "interrupted" in done.stdout, (done.stdout, done.stderr[-3000:])
        time.sleep(2)  # anything of the job's still alive now was left running
        left = list(processes_naming(token))
        assert not left, f"the job was left running: {len(left)} process(es) of it"
    finally:
        for pid in list(processes_naming(token)):  # never leave them to later tests
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
