"""Two ranks (gloo, CPU) probing together, for ``tests/test_ranks.py``.

Run as ``python tests/ranks_job.py OUT_DIR``: it spawns two processes that join one process
group through a file store in ``OUT_DIR`` (no port, so parallel runs cannot collide), runs the
scenarios below on real models, and each rank writes what it saw to ``OUT_DIR/rank{r}.json``.
The test reads those files; a hang shows as the test's subprocess timeout.

Scenarios, in order (the last one leaves the group unusable, so it is last):

* ``limits``: the built-in GPT wrapped in DDP, rank 0 under 64 MiB and rank 1 under 56 MiB,
  after the user's own training step (so DDP and the optimizer have run); single-process
  answers for each rank's limit; the state check; then a real DDP training step.
* ``phase_forward`` / ``phase_backward`` / ``phase_step``: an MLP trial at one batch size with
  rank 1's limit between the peaks of two phases, so that rank 1 alone runs out of memory in
  that phase; the state check and a real DDP step after each.
* ``error``: rank 1's model raises ``ValueError`` at batch 8 only.
* ``interrupt``: rank 0 sends itself SIGINT after the first trial.
* ``bucket_view``: DDP with ``gradient_as_bucket_view=True`` gets a note on what that costs.
* ``sync_batchnorm``, ``fsdp``: models with collectives inside forward are refused in-process,
  not probed (FSDP goes through ``batchfit probe --nproc-per-trial``).
* ``settings``: the ranks disagree on ``max_batch``.
* ``absent``: rank 1 never calls ``find()``.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import join_gloo
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import batchfit
from batchfit.examples import gpt
from batchfit.units import parse_memory_limit

WORLD = 2
TIMEOUT_S = 20.0
ABSENT_TIMEOUT_S = 3.0
LIMITS = ("64MiB", "56MiB")
PHASE_BATCH = 16


def mlp() -> nn.Module:
    """Big weights, small activations: its optimizer step needs more than its backward."""
    return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16))


class FailsAt(nn.Module):
    """An MLP that raises on one rank at one batch size: a bug, not an out-of-memory."""

    def __init__(self, rank: int, batch_size: int) -> None:
        super().__init__()
        self.net = mlp()
        self.rank, self.batch_size = rank, batch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.batch_size and dist.get_rank() == self.rank:
            raise ValueError(f"boom at batch {x.shape[0]}")
        return self.net(x)


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "rng": torch.get_rng_state(),
        "training": [m.training for m in model.modules()],
        "ddp_flag": getattr(model, "require_forward_param_sync", None),
    }


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [key for key in a if not same(a[key], b[key])]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> float:
    """A real DDP training step; returns a checksum of the parameters (equal on every rank when
    DDP synchronised the gradients)."""
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    loss = out["loss"] if isinstance(out, dict) else out.float().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def gpt_batch(sample: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    return {key: value[torch.arange(size) % value.shape[0]] for key, value in sample.items()}


def result_record(result: batchfit.Result, seconds: float) -> dict[str, Any]:
    return {
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "world_size": result.world_size,
        "budget_bytes": result.budget_bytes,
        "trials": [[t.batch_size, t.fits, t.phase, t.kind] for t in result.trials],
        "seconds": seconds,
    }


def scenario_limits(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, sample = gpt()
    reference_started = time.monotonic()
    # One process without DDP, under the limit less what a DDP rank holds besides: its gradient buckets.
    buckets = sum(p.numel() * p.element_size() for p in model.parameters())
    limit = parse_memory_limit(LIMITS[rank], None) - buckets
    alone = batchfit.find(copy.deepcopy(model), sample, memory_limit=limit, distributed=False)
    record: dict[str, Any] = {"alone": result_record(alone, time.monotonic() - reference_started), "buckets": buckets}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optimizer, gpt_batch(sample, 2))  # the user trained a step already (state to restore)
    # Wrapped afterwards: a DDP that already synchronised once rebuilds its gradient buckets in
    # its next forward (inside the probe), which the single-process reference would not see.
    ddp = DistributedDataParallel(model)
    before = state_of(ddp, optimizer)
    started = time.monotonic()
    result = batchfit.find(ddp, sample, optimizer=optimizer, memory_limit=LIMITS[rank], rank_timeout=TIMEOUT_S)
    record["together"] = result_record(result, time.monotonic() - started)
    record["notes"] = list(result.notes)
    record["restored"] = differences(before, state_of(ddp, optimizer))
    record["checksum_after_step"] = train_step(ddp, optimizer, gpt_batch(sample, result.safe_batch))
    return record


def phase_peaks(rank: int) -> dict[str, int]:
    """Each phase's peak of one fresh step at ``PHASE_BATCH``, measured by this rank alone."""
    torch.manual_seed(1)
    with batchfit.Prober(mlp(), torch.randn(4, 128), distributed=False) as prober:
        trial = prober.trial(PHASE_BATCH, steps=1)
    return dict(trial.phase_peaks)


def scenario_phase(rank: int, phase: str, peaks: dict[str, int]) -> dict[str, Any]:
    order = ["batch", "forward", "backward", "step"]
    below = max(peaks[p] for p in order[: order.index(phase)])
    if not below < peaks[phase]:
        raise AssertionError(f"the MLP's {phase} peak is not above the earlier phases: {peaks}")
    torch.manual_seed(2)
    ddp = DistributedDataParallel(mlp())
    buckets = sum(p.numel() * p.element_size() for p in ddp.parameters())  # DDP's, beside the peaks of one process
    limit = (below + peaks[phase]) // 2 + buckets if rank == 1 else None
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sample = torch.randn(4, 128)
    before = state_of(ddp, optimizer)
    with batchfit.Prober(ddp, sample, optimizer=optimizer, memory_limit=limit, rank_timeout=TIMEOUT_S) as prober:
        trial = prober.trial(PHASE_BATCH, steps=1)
    return {
        "fits": trial.fits,
        "phase": trial.phase,
        "message": trial.message,
        "restored": differences(before, state_of(ddp, optimizer)),
        "checksum_after_step": train_step(ddp, optimizer, torch.randn(PHASE_BATCH, 128)),
    }


def scenario_error(rank: int) -> dict[str, Any]:
    torch.manual_seed(3)
    ddp = DistributedDataParallel(FailsAt(rank=1, batch_size=8))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sample = torch.randn(4, 128)
    before = state_of(ddp, optimizer)
    try:
        batchfit.find(ddp, sample, optimizer=optimizer, strategy="binary", rank_timeout=TIMEOUT_S)
    except Exception as exc:  # what each rank raises is the point
        raised = {
            "type": type(exc).__name__,
            "message": str(exc),
            "rank": getattr(exc, "rank", None),
            "batch_size": getattr(exc, "batch_size", None),
        }
    else:
        raised = None
    return {
        "raised": raised,
        "restored": differences(before, state_of(ddp, optimizer)),
        "checksum_after_step": train_step(ddp, optimizer, torch.randn(6, 128)),  # not 8: rank 1 raises there
    }


def scenario_interrupt(rank: int) -> dict[str, Any]:
    torch.manual_seed(4)
    ddp = DistributedDataParallel(mlp())
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sample = torch.randn(4, 128)
    before = state_of(ddp, optimizer)
    trials: list[int] = []

    def after_trial(trial: batchfit.Trial) -> None:
        trials.append(trial.batch_size)
        if rank == 0 and len(trials) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    try:
        batchfit.find(ddp, sample, optimizer=optimizer, callback=after_trial, rank_timeout=TIMEOUT_S)
    except KeyboardInterrupt as exc:
        raised = {"type": "KeyboardInterrupt", "message": str(exc)}
    else:
        raised = None
    return {
        "raised": raised,
        "trials": trials,
        "restored": differences(before, state_of(ddp, optimizer)),
        "checksum_after_step": train_step(ddp, optimizer, torch.randn(8, 128)),
    }


def scenario_bucket_view(rank: int) -> dict[str, Any]:
    ddp = DistributedDataParallel(mlp(), gradient_as_bucket_view=True)
    result = batchfit.find(ddp, torch.randn(4, 128), max_batch=64, verify_steps=0, rank_timeout=TIMEOUT_S)
    return {"notes": list(result.notes), "max_batch": result.max_batch}


def scenario_sync_batchnorm(rank: int) -> dict[str, Any]:
    # (DDP refuses SyncBatchNorm on the CPU, so the module goes unwrapped: the check is batchfit's.)
    model = nn.Sequential(nn.Linear(128, 64), nn.SyncBatchNorm(64), nn.Linear(64, 4))
    try:
        batchfit.find(model, torch.randn(4, 128), rank_timeout=TIMEOUT_S)
    except NotImplementedError as exc:
        return {"raised": {"type": type(exc).__name__, "message": str(exc)}}
    return {"raised": None}


def scenario_fsdp(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    fully_shard(model)
    try:
        batchfit.find(model, torch.randn(4, 128), rank_timeout=TIMEOUT_S)
    except NotImplementedError as exc:
        return {"raised": {"type": type(exc).__name__, "message": str(exc)}}
    return {"raised": None}


def scenario_settings(rank: int) -> dict[str, Any]:
    ddp = DistributedDataParallel(mlp())
    try:
        batchfit.find(ddp, torch.randn(4, 128), max_batch=64 + rank, rank_timeout=TIMEOUT_S)
    except ValueError as exc:
        return {"raised": {"type": type(exc).__name__, "message": str(exc)}}
    return {"raised": None}


def scenario_absent(rank: int) -> dict[str, Any]:
    ddp = DistributedDataParallel(mlp())  # a collective: both ranks build it
    if rank == 1:
        return {"skipped": True}
    started = time.monotonic()
    try:
        batchfit.find(ddp, torch.randn(4, 128), rank_timeout=ABSENT_TIMEOUT_S)
    except Exception as exc:
        raised = {"type": type(exc).__name__, "message": str(exc)}
    else:
        raised = None
    return {"raised": raised, "seconds": time.monotonic() - started}


def run_rank(rank: int, out: str) -> None:
    record: dict[str, Any] = {}
    # Python's own Ctrl-C handler, as in a process started from a terminal (a child of a shell's
    # background job inherits SIGINT ignored, and then nothing could interrupt the probe).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        join_gloo(rank, out, WORLD)
        record["limits"] = scenario_limits(rank)
        peaks = phase_peaks(rank)
        record["phase_peaks"] = peaks
        for phase in ("forward", "backward", "step"):
            record[f"phase_{phase}"] = scenario_phase(rank, phase, peaks)
        record["error"] = scenario_error(rank)
        record["interrupt"] = scenario_interrupt(rank)
        record["bucket_view"] = scenario_bucket_view(rank)
        record["sync_batchnorm"] = scenario_sync_batchnorm(rank)
        record["fsdp"] = scenario_fsdp(rank)
        record["settings"] = scenario_settings(rank)
        record["absent"] = scenario_absent(rank)
    except BaseException:
        record["crash"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    assert parse_memory_limit(LIMITS[1], None) < parse_memory_limit(LIMITS[0], None)
    mp.spawn(run_rank, args=(sys.argv[1],), nprocs=WORLD, join=True)
