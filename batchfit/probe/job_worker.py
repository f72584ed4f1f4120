"""A job's rank side (`batchfit.probe.job_runner`'s jobs): one trial, its verdict in a file, and how the
driver reads the verdicts back and turns a failed rank into the error it raises.

Why a module of its own: the driver (`JobPerTrial`) and the rank (`batchfit.worker`, started once per
rank of each job) meet only in these files; each rank writes its verdict whole (a rename) as soon as it
has one, before anything else can hang, and the driver reads what is there.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from batchfit.errors import RankFailedError, RanksTimeoutError, first_line
from batchfit.probe.options import Options
from batchfit.probe.prober import Prober
from batchfit.probe.safe_batch import safe_cap

__all__ = ["raise_failure", "read_verdicts", "run_worker_trial", "worker_env", "write_verdict"]

#: What a rank's error says when it waited for another rank in vain (to join the group, in a collective).
_WAITED = ("RanksTimeoutError:", "DistStoreError:", "DistNetworkError:", "Timed out", "closed by peer", "reset by peer")


def raise_failure(batch_size: int, verdicts: dict[int, dict[str, Any]], world_size: int) -> None:
    """The error of a rank that failed on its own; where every error only says that its rank waited
    for others in vain, the ranks that gave no answer (stopped, stuck or dead) are the ones named."""
    errors = {rank: v for rank, v in sorted(verdicts.items()) if "error" in v}
    own = [rank for rank, v in errors.items() if not any(said in v["error"] for said in _WAITED)]
    silent = sorted(set(range(world_size)) - set(verdicts))
    if errors and not own and silent:
        rank, verdict = next(iter(errors.items()))
        raise RanksTimeoutError(
            f"the trial job at batch size {batch_size}: rank(s) {', '.join(map(str, silent))} gave no answer (stopped, "
            f"stuck or died; their own output says why, if anything) while rank(s) {', '.join(map(str, errors))} "
            f"waited for them; rank {rank} said, during {verdict.get('phase') or 'the trial'}: {verdict['error']}"
        )
    for rank in own or list(errors):
        verdict = errors[rank]
        raise RankFailedError(rank, batch_size, verdict.get("phase") or "the trial", verdict["error"])


def read_verdicts(out: Path) -> dict[int, dict[str, Any]]:
    """The verdict files the ranks of a job wrote so far (written whole: see `write_verdict`)."""
    verdicts = {}
    for path in out.glob("rank*.json"):
        with contextlib.suppress(ValueError, OSError):
            verdicts[int(path.stem.removeprefix("rank"))] = json.loads(path.read_text())
    return verdicts


def write_verdict(out: Path, rank: int, verdict: dict[str, Any]) -> None:
    """Write a rank's verdict whole (a rename), so the driver never reads half a file."""
    partial = out / f".rank{rank}.json.partial"
    partial.write_text(json.dumps(verdict))
    partial.replace(out / f"rank{rank}.json")


def run_worker_trial(
    model: Any,
    sample: Any,
    options: Options,
    batch_size: int,
    steps: int,
    out: Path,
    rank: int,
    cap_bytes: int | None = None,
    headroom: float | None = None,
) -> int:
    """One rank's side of a job: one trial (under ``cap_bytes`` when given, or under this rank's
    budget less ``headroom``), its verdict written before anything can hang."""
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    phase = "the probe's set-up"
    try:
        with Prober(model, sample, options=replace(options, distributed=False)) as prober:
            phase = "the trial"
            if headroom is not None and prober.budget_bytes is not None:
                cap_bytes = safe_cap(prober.budget_bytes, headroom)
            trial = prober.trial(batch_size, steps=steps, cap_bytes=cap_bytes)
            local = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]  # a shard's own bytes
            weights = sum(p.numel() * p.element_size() for p in local)
            trainable = sum(p.numel() * p.element_size() for p, q in zip(local, model.parameters()) if q.requires_grad)
            write_verdict(out, rank, {
                "trial": asdict(trial),
                "budget_bytes": prober.budget_bytes,
                "cap_bytes": cap_bytes,
                "counts": prober.counts,
                "device": asdict(prober.device_info),
                "limit_bytes": prober.limit_bytes,
                "limit_source": prober.limit_source,
                "reserve_bytes": prober.reserve_bytes,
                "weights_bytes": weights,
                "trainable_bytes": trainable,
                "optimizer_state_bytes": prober.optimizer_state_bytes,
                "fixed_advice": None if trial.fits else prober.fixed_advice(),
                "torch": torch.__version__,
            })  # fmt: skip
    except Exception as exc:
        if not (out / f"rank{rank}.json").exists():
            write_verdict(out, rank, {"error": first_line(exc), "phase": phase})
        return 1
    return 0


def worker_env() -> dict[str, str]:
    """The environment of a job: this process's, one thread per rank unless it says otherwise."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    return env
