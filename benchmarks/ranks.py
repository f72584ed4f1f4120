"""Two ranks against one process: answers, wall times, and what deferring DDP's gradient sync costs.

Run from the repository root::

    python benchmarks/ranks.py                     # every case, about 1-2 minutes on 2 cores
    python benchmarks/ranks.py --case gpt@64MiB

Two questions, on CPU with gloo (each rank one torch thread; the single process one thread too,
so both sides do the same work per process):

1. **The answer and the time.** Per case, ``find()`` in one process, then ``find()`` on two
   ranks (spawned, file-store rendezvous, the model wrapped in DDP), each rank under the same
   live-tensor cap; each side runs ``find()`` once to warm up and times the second run.
   Answers agree up to DDP's gradient buckets (a rank holds one more gradient's bytes than one
   process: `batchfit.distributed.buckets`); the wall time shows what the meetings (one gloo
   all-reduce per phase of every step, one gather per trial) and the second process on a 2-core
   machine cost.
2. **Memory of the deferred step.** A probe step runs DDP under ``no_sync()`` and all-reduces
   the gradients itself once every rank's backward worked (``batchfit/ranks.py``). Per batch
   size, the peaks per phase of a real synchronised DDP step (``distributed=False``: DDP as the
   user runs it) and of the probe's deferred step (``distributed=True``), both measured by the
   live-tensor meter on both ranks, two steps from a fresh optimizer (both count the buckets; the
   synchronised step's first step also sees DDP rebuild them once).

Output: a table on stdout and JSON under ``benchmarks/results/ranks-cpu-*.json``. Nothing here
asserts a timing.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import batchfit
from batchfit.examples import gpt
from batchfit.units import format_bytes

RESULTS = Path(__file__).resolve().parent / "results"
CASES = {"gpt@64MiB": "64MiB", "gpt@256MiB": "256MiB"}
MEMORY_BATCHES = (4, 16, 32)
WORLD = 2


def one_process(limit: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, sample = gpt()
    batchfit.find(model, sample, memory_limit=limit, distributed=False)  # warm-up: first-use costs
    started = time.perf_counter()
    result = batchfit.find(model, sample, memory_limit=limit, distributed=False)
    return {
        "wall_s": time.perf_counter() - started,
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "trials": len(result.trials),
        "best_samples_per_s": result.throughput.best_samples_per_s if result.throughput else None,
    }


def _rank(rank: int, store: str, limit: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model, sample = gpt()
    ddp = DistributedDataParallel(model)
    record: dict[str, Any] = {}
    batchfit.find(ddp, sample, memory_limit=limit, rank_timeout=120)  # warm-up: first-use costs
    dist.barrier()
    started = time.perf_counter()
    result = batchfit.find(ddp, sample, memory_limit=limit, rank_timeout=120)
    record["find"] = {
        "wall_s": time.perf_counter() - started,
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "trials": len(result.trials),
        "best_samples_per_s": result.throughput.best_samples_per_s if result.throughput else None,
    }
    memory = []
    for bucket_view in (False, True):
        model, sample = gpt()
        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        for batch in MEMORY_BATCHES:
            peaks = {}
            for label, together in (("synced", False), ("deferred", True)):
                with batchfit.Prober(wrapped, sample, distributed=together, rank_timeout=120) as prober:
                    trial = prober.trial(batch, steps=2)
                peaks[label] = dict(trial.phase_peaks)
            memory.append({"batch": batch, "gradient_as_bucket_view": bucket_view, **peaks})
    record["memory"] = memory
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def two_ranks(limit: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        mp.spawn(_rank, args=(f"{out}/store", limit, out), nprocs=WORLD, join=True)
        wall = time.perf_counter() - started
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {"job_wall_s": wall, "ranks": ranks}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    args = parser.parse_args(argv)
    cases = []
    print(f"{'case':<12} {'who':<10} {'max':>5} {'safe':>5} {'trials':>6} {'find() s':>9} {'samples/s':>10}")
    for name in args.case or list(CASES):
        limit = CASES[name]
        alone = one_process(limit)
        together = two_ranks(limit)
        cases.append({"case": name, "limit": limit, "one_process": alone, "two_ranks": together})
        print(f"{name:<12} {'1 process':<10} {alone['max_batch']:>5} {alone['safe_batch']:>5} {alone['trials']:>6} "
              f"{alone['wall_s']:>9.2f} {alone['best_samples_per_s'] or 0:>10.1f}")  # fmt: skip
        for rank, record in enumerate(together["ranks"]):
            found = record["find"]
            who = f"rank {rank}/2"
            print(f"{'':<12} {who:<10} {found['max_batch']:>5} {found['safe_batch']:>5} {found['trials']:>6} "
                  f"{found['wall_s']:>9.2f} {found['best_samples_per_s'] or 0:>10.1f}")  # fmt: skip
        ratio = together["ranks"][0]["find"]["wall_s"] / alone["wall_s"]
        print(f"{'':<12} two ranks / one process: {ratio:.2f}x wall time (samples/s of 2 ranks is the group's)")
        print(f"{'':<12} memory per rank, synced DDP step vs the probe's deferred step (rank 0):")
        for row in together["ranks"][0]["memory"]:
            cells = []
            for phase in ("forward", "backward", "step"):
                synced, deferred = row["synced"].get(phase), row["deferred"].get(phase)
                if synced is not None and deferred is not None:
                    cells.append(
                        f"{phase} {format_bytes(synced)} / {format_bytes(deferred)} ({deferred - synced:+,} B)"
                    )
            view = "bucket views" if row["gradient_as_bucket_view"] else "default DDP"
            print(f"{'':<14}{view:<13} batch {row['batch']:>3}: " + "; ".join(cells))
    document = {
        "schema": "batchfit.ranks-benchmark/1",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "batchfit": batchfit.__version__,
        "world_size": WORLD,
        "cases": cases,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"ranks-cpu-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(document, indent=1))
    print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    return document


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
