"""Fewer jobs: the job-per-trial search from ``init_batch`` against the same search from the sharded estimate.

Run from the repository root::

    python benchmarks/sharded_jobs.py                 # W = 2 and 4, a few minutes on 2 busy cores
    python benchmarks/sharded_jobs.py --world 2       # one world size

Per world size W, the GPT of ``benchmarks/sharded_targets.py`` (``fully_shard`` per block, then the
root) under one per-rank memory limit, on the CPU over gloo, one after the other:

* **plain**: ``batchfit.find_sharded(target, W, memory_limit=..., estimate=False)``: every trial a
  fresh ``torchrun`` job of W ranks, the search from ``init_batch`` (what ``--nproc-per-trial`` did
  before the estimate);
* **from the estimate**: ``batchfit.find_sharded(target, W, memory_limit=...)``: the sharded estimate
  first (a process on a fake group, no job), then its safe batch verified by the first job and the
  boundary by the next ones. Its time includes the estimate's.

Both are exact (the boundary's two neighbours measured, the safe batch verified by real steps), so
their answers must be equal; the table shows them side by side with the jobs and seconds of each.
Output: the table and JSON under ``benchmarks/results/sharded-jobs-cpu-*.json``. Nothing here
asserts a timing.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import batchfit

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  (this directory, not a package)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGET = f"{HERE / 'sharded_targets.py'}:gpt"
#: The per-rank limit that puts the GPT's boundary in the tens (the estimate benchmark's).
LIMIT = "128MiB"
WORLDS = (2, 4)


def run(world: int, estimate: bool) -> dict[str, Any]:
    """One search, timed from the call to the answer; its jobs counted from the result's note."""
    with tempfile.TemporaryDirectory() as folder:
        started = time.monotonic()
        result = batchfit.find_sharded(
            TARGET,
            world,
            memory_limit=LIMIT,
            device="cpu",
            estimate=estimate,
            trial_log=Path(folder) / "trials.jsonl",
            rank_timeout=120.0,
        )
        wall = time.monotonic() - started
    notes = " ".join(result.notes)
    jobs = re.search(r"\((\d+) job\(s\) started", notes)
    made = re.search(r"sharded estimate \(max batch (\d+), safe batch (\d+) per rank, made in ([\d.]+) s", notes)
    return {
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "safe_verified": result.safe_verified,
        "boundary_reached": result.boundary_reached,
        "strategy": result.settings.strategy,
        "jobs": int(jobs.group(1)) if jobs else None,
        "estimate": {"max_batch": int(made[1]), "safe_batch": int(made[2]), "wall_s": float(made[3])} if made else None,
        "trials": [[t.batch_size, t.kind, t.fits] for t in result.trials],
        "notes": list(result.notes),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, choices=WORLDS, action="append")
    args = parser.parse_args(argv)
    header = (
        f"{'W':>2} {'limit':>7} | {'plain max':>9} {'safe':>5} {'jobs':>4} {'s':>6} | "
        f"{'est max':>7} {'safe':>5} {'s':>5} | {'guided max':>10} {'safe':>5} {'jobs':>4} {'s':>6} | {'equal':>5}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for world in args.world or list(WORLDS):
        plain = run(world, estimate=False)
        guided = run(world, estimate=True)
        equal = (plain["max_batch"], plain["safe_batch"]) == (guided["max_batch"], guided["safe_batch"])
        rows.append({"model": "gpt", "world_size": world, "limit": LIMIT, "plain": plain, "from_estimate": guided,
                     "equal": equal})  # fmt: skip
        made = guided["estimate"] or {"max_batch": "-", "safe_batch": "-", "wall_s": float("nan")}
        print(
            f"{world:>2} {LIMIT:>7} | {plain['max_batch']:>9} {plain['safe_batch']:>5} {plain['jobs']:>4} "
            f"{plain['wall_s']:>6.1f} | {made['max_batch']:>7} {made['safe_batch']:>5} {made['wall_s']:>5.1f} | "
            f"{guided['max_batch']:>10} {guided['safe_batch']:>5} {guided['jobs']:>4} {guided['wall_s']:>6.1f} | "
            f"{'yes' if equal else 'NO':>5}",
            flush=True,
        )
    document = {
        "schema": "batchfit.sharded-jobs-benchmark/1",
        **compare.stamp(argv),
        "machine": compare.machine(),
        "versions": compare.versions(),
        "rows": rows,
    }
    compare.write_results(document, RESULTS, "sharded-jobs-cpu")
    return document


if __name__ == "__main__":
    main()
