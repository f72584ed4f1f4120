"""A child process in a session of its own, ended whole on every way out: the jobs' and the estimate's.

Why a session: a torchrun job (`batchfit.probe.job_runner`) or the sharded estimate's process
(`batchfit.estimation.rank_estimate`) may start processes of its own; killing the child alone would leave
them running (a trial holding GPUs on a cluster). In a session of its own the child is the leader of
a process group that holds them all, and a terminal's Ctrl-C reaches only this process, which then
ends the group itself.

Why a guard while it starts: ``Popen`` forks, execs and then waits for the exec to succeed; a
Ctrl-C there, or between ``Popen`` returning and its handle being stored, raised a
``KeyboardInterrupt`` with the child running and no handle to kill it by (issue 48: torchrun and
both ranks ran their trial to the end). So the child starts inside `batchfit.interrupts`'s guard,
in a critical section: a Ctrl-C there is only recorded, and raised once the handle is held, where
the way out ends the group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from batchfit.interrupts import InterruptGuard

__all__ = ["children", "end_group", "end_torchrun", "in_session"]


@contextlib.contextmanager
def in_session(
    command: Sequence[str], end: Callable[[subprocess.Popen[Any]], None] | None = None, **popen: Any
) -> Iterator[subprocess.Popen[Any]]:
    """``command`` started in a session of its own, and ended by ``end`` (default: `end_group`) on
    the way out, however it comes: a return, an error, a Ctrl-C, one while it starts included. The
    end runs to its finish (a second Ctrl-C there is recorded and raised after it). Both hold where
    the guard takes over SIGINT: the main thread, Python's handler or a guard's in place."""
    job: subprocess.Popen[Any] | None = None
    try:
        with InterruptGuard() as guard, guard.critical():  # a Ctrl-C here surfaces once `job` is set
            job = subprocess.Popen(list(command), start_new_session=True, **popen)
        yield job
    finally:
        if job is not None:
            with InterruptGuard() as guard, guard.critical():
                (end or end_group)(job)


def end_group(job: subprocess.Popen[Any], wait_s: float = 30.0) -> None:
    """Kill ``job``'s process group (its session's: the child and whatever it started) and reap it."""
    with contextlib.suppress(OSError):
        os.killpg(job.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.wait(timeout=wait_s)


def end_torchrun(job: subprocess.Popen[Any], out: Path) -> None:
    """End a torchrun job (`batchfit.probe.job_runner`): every rank and what it started (torchrun starts
    each in a session of its own, so a rank is found by its pid file in ``out`` or, before it wrote
    one, as torchrun's child), then torchrun. torchrun is stopped first, so that it starts no rank
    while its ranks are being killed."""
    with contextlib.suppress(OSError):
        os.killpg(job.pid, signal.SIGSTOP)
    ranks = set(children(job.pid))
    for path in out.glob("rank*.pid"):
        with contextlib.suppress(ValueError, OSError):
            ranks.add(int(path.read_text()))
    for pid in ranks:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # the rank's session: its own children too
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    end_group(job)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, read from Linux's /proc (elsewhere none)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(ValueError, OSError, IndexError):
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:  # "pid (name) state ppid ..."
                found.append(int(stat.parent.name))
    return found
