"""Every rank of a ``torch.distributed`` job probing together: `Group`, and `ranks_for`.

A probe over several ranks must end with one answer everywhere and must never hang. Both follow
from one rule: **the ranks meet after every phase of every step** (batch, forward, backward,
optimizer step), over a side gloo group of their own with an explicit timeout, and each says how
its phase went: fine, out of memory, another error, or interrupted (Ctrl-C). The worst outcome
wins on every rank at once:

* an out-of-memory on any rank fails the trial on every rank (`PeerOutOfMemory` where the
  rank itself was fine), so every rank feeds the same verdict to the same search and takes the
  same next step. NCCL running out of device memory for its own buffers in a collective of the
  data group (``DistBackendError`` "... Cuda failure 'out of memory'") is this rank's out-of-memory
  too, by the same rule as any other (``batchfit.backends.is_oom``), not another error;
* another error on any rank makes every other rank raise [`RankFailedError`][batchfit.errors.RankFailedError]
  naming that rank, the batch size, the phase and the original message;
* a Ctrl-C on any rank raises ``KeyboardInterrupt`` on every rank (the probe's interrupt guard
  defers it to the next meeting, see ``batchfit.interrupts``), and every rank restores its model;
* a rank that dies (killed, crashed) closes its connections: the others raise
  [`RanksTimeoutError`][batchfit.errors.RanksTimeoutError] at once, saying it went away, where and when.

Why a side gloo group: right after an out-of-memory the device may have nothing left, a gloo
collective runs on CPU tensors; NCCL has no bitwise reductions (pytorch #41362) and its
collectives cannot time out cleanly. Why meetings and not only a verdict per trial: a rank that
runs out of memory while its peers wait inside a collective of the *data* group is the classic
hang (Composer's PRs #2117, #3016, #3510). So no data collective may start unless every rank got
to it. DDP's gradient all-reduce runs inside backward; a probe step therefore runs DDP under
``no_sync()`` and all-reduces the gradients itself at the start of the optimizer step, once the
ranks agreed that backward worked everywhere (`Group.sync_gradients`). DDP's gradient
buckets are allocated when the model is wrapped and held in every step, synchronised or not: a
device's allocator counts them, and the CPU meter is told of them (``batchfit.distributed.buckets``).
The only other collective in a DDP step, the buffer broadcast at the start of forward, runs after
the batch phase was agreed.

What is *not* made safe in-process: collectives inside the model's own forward or backward
(FSDP, ``SyncBatchNorm``, tensor parallelism). A rank that fails before such a collective leaves
its peers waiting in it; `ranks_for` refuses those models with a clear error rather than
risk the hang. Sharded models are probed a job per trial instead (``batchfit.probe.job_runner``).

Combined across ranks (`Group.combine`): a trial fits only where it fits on every rank; its
peaks are the maximum over ranks, its step time the slowest rank's, its samples/s that of the
whole group (``world_size * batch / slowest step``); the budget is the smallest rank's.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from batchfit.backends import is_oom
from batchfit.distributed.buckets import ddp_of, grad_buckets
from batchfit.distributed.solo import FAILED, INTERRUPTED, OK, OUT_OF_MEMORY, PHASES, PeerOutOfMemory, Solo
from batchfit.errors import RankFailedError, RanksTimeoutError, first_line
from batchfit.interrupts import InterruptGuard
from batchfit.report import Trial
from batchfit.units import format_bytes

__all__ = ["Group", "combine_trials", "leads", "ranks_for"]

#: What gloo says when a peer's connection closes (the process exited or was killed).
_GONE = re.compile(r"(closed|reset) by peer|Broken pipe|Connection refused", re.IGNORECASE)
#: The number of the meeting an exception left (every rank met on it): a meeting around that one does not.
_MET = "_batchfit_ranks_met"


class Group(Solo):
    """Every rank of the initialised default process group (see the module docs)."""

    def __init__(self, timeout_s: float, interrupts: InterruptGuard) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.timeout_s = timeout_s
        self._interrupts = interrupts
        self._group: Any = None
        self._meetings = 0
        #: The first rank that ran out of memory in the current trial, and what it said.
        self._out_of_memory: tuple[int, str] | None = None
        #: Every rank that ran out of memory itself in the current trial.
        self._out_of_memory_ranks: set[int] = set()
        #: Every trial's per-rank records and the ranks that ran out of memory themselves, in order:
        #: each rank's own answer is read from them (``batchfit.probe.per_rank``).
        self.history: list[tuple[tuple[Trial, ...], frozenset[int]]] = []

    # meetings ----------------------------------------------------------------------------------
    def join(self, settings: dict[str, Any]) -> None:
        """Create the side gloo group (every rank must call ``find()``: a rank that does not is
        reported after the timeout) and check that every rank searches the same way: ranks that
        disagree on the grid or the strategy would take different paths and never meet again.
        Joined already (the result cache met the ranks before the probe did): nothing to do."""
        if self._group is not None:
            return
        try:
            self._group = self._dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise RanksTimeoutError(
                f"rank {self.rank} waited {self.timeout_s:g} s for all {self.world_size} ranks to start batchfit, "
                f"and not every rank did: every rank must call find() (or Prober) together; a rank that raised "
                f"before starting shows its own error ({first_line(exc)})"
            ) from None
        everyone: list[Any] = [None] * self.world_size
        self._collective("joining", lambda: self._dist.all_gather_object(everyone, settings, group=self._group))
        for rank, theirs in enumerate(everyone):
            differ = sorted(key for key in settings if theirs.get(key) != settings[key])
            if differ:
                shown = ", ".join(
                    f"{key}={settings[key]!r} on rank {self.rank}, {theirs.get(key)!r} on rank {rank}" for key in differ
                )
                raise ValueError(f"the ranks must search with the same settings, or they take different paths: {shown}")

    @contextlib.contextmanager
    def meet(self, phase: str, batch_size: int | None = None) -> Iterator[None]:
        entered = self._meetings
        try:
            yield
        except (PeerOutOfMemory, RankFailedError, RanksTimeoutError, GeneratorExit):
            raise  # raised by a meeting: every rank already knows
        except BaseException as exc:
            if getattr(exc, _MET, 0) > entered:
                raise  # it left a meeting inside this one (`sync_gradients`'): every rank met on it
            status = FAILED
            if isinstance(exc, KeyboardInterrupt):
                status = INTERRUPTED
            elif is_oom(exc):
                status = OUT_OF_MEMORY
            self._meet(status, phase, batch_size, _report(exc))
            setattr(exc, _MET, self._meetings)
            raise
        self._meet(OK, phase, batch_size, "")

    def _meet(self, status: int, phase: str, batch_size: int | None, message: str) -> None:
        """Say how the phase went and act on the worst answer (see the module docs). Returns
        when this rank goes on (all fine) or when its own failure is the one to raise."""
        self._meetings += 1
        interrupted = self._interrupts.take()
        said = max(status, INTERRUPTED if interrupted else OK)
        # One all-reduce in the common case: [worst status, meeting number, -meeting number].
        where = PHASES.get(phase, phase) + ("" if batch_size is None else f" at batch size {batch_size}")
        worst, latest, earliest = self._maximum(where, [said, self._meetings, -self._meetings])
        if latest != -earliest:
            raise RuntimeError(
                f"batchfit: the ranks are out of step at {where} (meetings {-earliest} to {latest}): a rank ran a "
                "different search; every rank must call find() with the same arguments"
            )
        if worst == OK:
            return
        reports: list[Any] = [None] * self.world_size
        self._collective(where, lambda: self._dist.all_gather_object(reports, (said, message), group=self._group))
        first = {
            code: next((r for r, (s, _) in enumerate(reports) if s == code), None) for code in (FAILED, INTERRUPTED)
        }
        if worst == FAILED:
            failed = first[FAILED]
            assert failed is not None
            if status == FAILED:
                return  # this rank's own error is raised by the caller
            raise RankFailedError(failed, batch_size, PHASES.get(phase, phase), reports[failed][1])
        if worst == INTERRUPTED:
            if status == INTERRUPTED:
                return
            interrupt = KeyboardInterrupt(f"rank {first[INTERRUPTED]} was interrupted during {where}: every rank stops")
            setattr(interrupt, _MET, self._meetings)
            raise interrupt
        oom = next(r for r, (s, _) in enumerate(reports) if s == OUT_OF_MEMORY)
        self._out_of_memory = (oom, reports[oom][1])
        self._out_of_memory_ranks.update(r for r, (s, _) in enumerate(reports) if s == OUT_OF_MEMORY)
        if status == OUT_OF_MEMORY:
            return
        raise PeerOutOfMemory(oom, reports[oom][1])

    def any(self, flag: bool) -> bool:
        return bool(self._maximum("a check", [int(flag)])[0])

    def _maximum(self, where: str, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the ranks."""

        def reduce() -> list[int]:
            flags = torch.tensor(values, dtype=torch.int64)  # made here: unseen by the meter too
            self._dist.all_reduce(flags, op=self._dist.ReduceOp.MAX, group=self._group)
            return [int(v) for v in flags.tolist()]

        return self._collective(where, reduce)

    def smallest(self, value: int | None) -> int | None:
        known = [v for v in self.gather(value, "agreeing on the budget") if v is not None]
        return min(known) if known else None

    def gather(self, value: Any, where: str = "gathering every rank's value") -> list[Any]:
        values: list[Any] = [None] * self.world_size
        self._collective(where, lambda: self._dist.all_gather_object(values, value, group=self._group))
        return values

    def combine(self, trial: Trial) -> Trial:
        trials: list[Any] = [None] * self.world_size
        self._collective(
            f"the end of the trial at batch size {trial.batch_size}",
            lambda: self._dist.all_gather_object(trials, trial, group=self._group),
        )
        out_of_memory, self._out_of_memory = self._out_of_memory, None
        self.history.append((tuple(trials), frozenset(self._out_of_memory_ranks)))
        self._out_of_memory_ranks = set()
        return combine_trials(trials, out_of_memory)

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank, broadcast over the side gloo group."""
        box = [value if self.rank == 0 else None]
        self._collective(
            "sharing rank 0's decision", lambda: self._dist.broadcast_object_list(box, src=0, group=self._group)
        )
        return box[0]

    def _collective(self, where: str, call: Any) -> Any:
        """Run a control collective unseen by any dispatch mode (the CPU meter must not count
        the control tensors), turning a timeout or a rank gone into an error that says where."""
        from torch.utils._python_dispatch import _disable_current_modes

        started = time.monotonic()
        try:
            with _disable_current_modes(), torch.inference_mode(False):
                return call()
        except RuntimeError as exc:
            raise RanksTimeoutError(self._no_answer(where, exc, time.monotonic() - started)) from None

    def _no_answer(self, where: str, exc: RuntimeError, waited_s: float) -> str:
        """Why a control collective failed: a rank went away (gloo sees its connection close at
        once, long before the timeout), or not every rank answered in time. Only in a group of
        two is the rank that went away known for sure (gloo names an address, not a rank)."""
        if _GONE.search(str(exc)) is None:
            return (
                f"rank {self.rank}: not every rank answered within {self.timeout_s:g} s at {where}; a rank is stuck "
                f"in the model's code, died, or stopped calling batchfit ({first_line(exc)})"
            )
        gone = f"rank {1 - self.rank}" if self.world_size == 2 else "a rank"
        clock = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
        return (
            f"rank {self.rank}: {gone} went away during {where}, at {clock} UTC, {waited_s:.1f} s into the meeting: "
            f"it exited, crashed or was killed, and its own output says why ({first_line(exc)})"
        )

    # DDP ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def deferred_sync(self, model: nn.Module) -> Iterator[None]:
        ddp = ddp_of(model)
        with super().deferred_sync(model):
            if ddp is None:
                yield
                return
            # no_sync() keeps backward's all-reduce back; DDP also flips this flag in a no_sync()
            # forward, which would skip the buffer broadcast of the user's next forward.
            flag = ddp.require_forward_param_sync
            try:
                with ddp.no_sync():
                    yield
            finally:
                ddp.require_forward_param_sync = flag

    def sync_gradients(self, model: nn.Module, phase: str = "step", batch_size: int | None = None) -> None:
        """All-reduce (average) the gradients over DDP's own process group, as DDP would have in
        backward: the ranks agreed that backward worked everywhere, and in a meeting at ``phase`` that
        each made the buffer the buckets pass through, before any rank enters an all-reduce."""
        ddp = ddp_of(model)
        if ddp is None:
            return
        grads = [p.grad for p in ddp.parameters() if p.grad is not None]
        size = self._dist.get_world_size(ddp.process_group)
        # In buckets of DDP's own size, as DDP reduces them (one collective per gradient would
        # make the timed step far slower than training's); without DDP's overlap with backward,
        # so a step under DDP is timed a little slower than training runs it. One buffer per device,
        # its largest bucket's size (the last wins), serves every bucket in turn: one bucket's memory.
        buckets = grad_buckets(grads, int(getattr(ddp, "bucket_bytes_cap", 25 * 2**20)))
        sizes = [sum(grad.numel() * grad.element_size() for grad in bucket) for bucket in buckets]
        largest = {b[0].device: n for n, b in sorted(zip(sizes, buckets), key=lambda pair: pair[0])}
        with self.meet(phase, batch_size):
            buffers = {device: torch.empty(n, dtype=torch.uint8, device=device) for device, n in largest.items()}
        for bucket, nbytes in zip(buckets, sizes):
            flat = buffers[bucket[0].device][:nbytes].view(bucket[0].dtype)
            views = [part.view(grad.shape) for grad, part in zip(bucket, flat.split([g.numel() for g in bucket]))]
            torch._foreach_copy_(views, bucket)
            self._dist.all_reduce(flat, group=ddp.process_group)
            flat.div_(size)
            torch._foreach_copy_(bucket, views)

    def notes(self, model: nn.Module) -> list[str]:
        ddp = ddp_of(model)
        if ddp is None or not getattr(ddp, "gradient_as_bucket_view", False):
            return []
        grads = sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)
        return [
            "DDP(gradient_as_bucket_view=True): a probe step synchronises the gradients after backward, so they "
            f"live outside DDP's buckets, up to one gradient copy ({format_bytes(grads)}) more than your training "
            "steps hold: the batch sizes found are conservative by about that much"
        ]

    def close(self, settled: bool = False) -> None:
        super().close(settled)
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):
                if settled:  # a rank that tears its sockets down while a peer still reads the last
                    # meeting's answer aborts that peer ("terminate called without an active exception")
                    self._collective("the end", lambda: self._dist.barrier(group=group))
                self._dist.destroy_process_group(group)


def combine_trials(trials: list[Trial], out_of_memory: tuple[int, str] | None = None) -> Trial:
    """One trial from every rank's record of it (see the module docs). ``out_of_memory``: the
    rank that ran out of memory first, and its message (the others only heard of it)."""
    first = trials[0]
    failed = [t for t in trials if not t.fits]
    peaks = _max_phases(t.phase_peaks for t in trials)
    reserved = _max_phases(t.phase_reserved_peaks for t in trials)
    common = {
        "phase_peaks": peaks,
        "phase_reserved_peaks": reserved,
        "leaked_bytes": max(t.leaked_bytes for t in trials),
        "skipped_steps": max(t.skipped_steps for t in trials),
        "steps": min(t.steps for t in trials),
    }
    if failed:
        # What the size needs is at least what any rank measured or was refused.
        needed = [b for t in trials for b in (t.peak_bytes, *(p for _, p in t.phase_peaks)) if b is not None]
        needed_reserved = [
            b for t in trials for b in (t.reserved_peak_bytes, *(p for _, p in t.phase_reserved_peaks)) if b is not None
        ]
        message = failed[0].message
        if out_of_memory is not None:
            message = f"rank {out_of_memory[0]}: {out_of_memory[1]}"
        return replace(
            first,
            fits=False,
            phase=failed[0].phase,
            peak_bytes=max(needed, default=None),
            reserved_peak_bytes=max(needed_reserved, default=None),
            message=message,
            step_time_s=None,
            samples_per_s=None,
            step_times_s=(),
            **common,
        )
    slowest = max((t.step_time_s for t in trials if t.step_time_s is not None), default=None)
    lengths = {len(t.step_times_s) for t in trials}
    step_times = tuple(map(max, zip(*(t.step_times_s for t in trials)))) if len(lengths) == 1 else first.step_times_s
    return replace(
        first,
        peak_bytes=max((t.peak_bytes for t in trials if t.peak_bytes is not None), default=None),
        reserved_peak_bytes=max(
            (t.reserved_peak_bytes for t in trials if t.reserved_peak_bytes is not None), default=None
        ),
        step_time_s=slowest,
        samples_per_s=len(trials) * first.batch_size / slowest if slowest else None,
        step_times_s=step_times,
        **common,
    )


def _report(exc: BaseException) -> str:
    """What this rank tells the others about its failed phase: the first line of ``exc``, and for
    an NCCL error its "Last error" too. NCCL's first line names only the call and "unhandled cuda
    error"; the reason ("Cuda failure 'out of memory'", which made it an out-of-memory) follows
    ``getNcclErrorDetailStr``'s "Last error:" line, so the record on every rank says why."""
    said = first_line(exc)
    _, marker, last_error = str(exc).partition("\nLast error:\n")
    reason = last_error.strip().splitlines()[0].strip() if marker and last_error.strip() else ""
    return f"{said} ({reason})" if reason else said


def _max_phases(per_rank: Any) -> tuple[tuple[str, int], ...]:
    merged: dict[str, int] = {}
    for peaks in per_rank:
        for phase, value in peaks:
            merged[phase] = max(merged.get(phase, value), value)
    return tuple(merged.items())


#: Modules whose forward or backward runs collectives of its own (see the module docs), and what
#: to do instead.
_COLLECTIVE_MODULES = {
    "FullyShardedDataParallel": "run 'batchfit probe TARGET --nproc-per-trial N' (a fresh job per trial)",
    "FSDPModule": "run 'batchfit probe TARGET --nproc-per-trial N' (a fresh job per trial)",
    "SyncBatchNorm": "probe with torch.nn.BatchNorm layers in its place (they hold the same memory)",
}


def ranks_for(distributed: bool | None, timeout_s: float, model: nn.Module, interrupts: InterruptGuard) -> Solo:
    """The ranks a probe runs on: ``distributed`` (``None``: every rank of an initialised default
    process group of more than one rank, else this process alone; see ``batchfit.find``), meeting
    with a timeout of ``timeout_s`` seconds."""
    import torch.distributed as dist

    ready = dist.is_available() and dist.is_initialized()
    if distributed is None:
        wanted = ready and dist.get_world_size() > 1
    elif distributed and not ready:
        raise ValueError(
            "distributed=True needs an initialised default process group: call "
            "torch.distributed.init_process_group() first (torchrun sets up its environment)"
        )
    else:
        wanted = bool(distributed)
    if not wanted:
        return Solo()
    for module in model.modules():
        found = next((cls.__name__ for cls in type(module).__mro__ if cls.__name__ in _COLLECTIVE_MODULES), None)
        if found is not None:
            raise NotImplementedError(
                f"batchfit cannot probe a model with {found} across ranks in-process: "
                f"{_COLLECTIVE_MODULES[found]}, or probe one rank alone with distributed=False "
                "(see docs/how-to/many-gpus.md#sharded-models-a-fresh-job-per-trial)"
            )
    return Group(timeout_s, interrupts)


def leads(distributed: bool | None) -> bool:
    """Whether this process speaks for the probe (shows its progress): rank 0 of the group
    `ranks_for` would pick for ``distributed``, or this process when it probes alone. Under
    ``torchrun --nnodes N --nproc-per-node G`` that is one process of the N x G, on one node."""
    import torch.distributed as dist

    if distributed is False or not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_world_size() < 2 or dist.get_rank() == 0
