"""The sharded estimate against the real job-per-trial probe: FSDP2 models at world sizes 2 and 4 on the CPU.

Run from the repository root (transformers is needed for the Llama case)::

    python benchmarks/sharded_estimate.py                        # every case, about 10 minutes on 2 busy cores
    python benchmarks/sharded_estimate.py --case gpt --world 2   # one model at one world size
    python benchmarks/sharded_estimate.py --large                # only the 1.1B Llama, 8 ranks of 80 GiB (cuda)

Per case (a target of ``benchmarks/sharded_targets.py``, each block a ``fully_shard`` unit, then the
root; one per-rank memory limit), one after the other:

* **estimate**: ``batchfit.estimation.rank_estimate.estimate_sharded(target, W, memory_limit=limit,
  device="cpu")``: a fresh process that joins a fake process group of W ranks as rank 0, then
  runs the probe's search over fake trials (each a fresh build of the target, two steps with a
  fresh optimizer, as a job runs). Timed from the call to the answer (the process's start included).
* **jobs**: ``python -m batchfit probe TARGET --nproc-per-trial W --memory-limit limit --no-estimate
  --json``: every trial a real ``torchrun`` job of W gloo ranks, each rank under the live-tensor
  meter's limit, the search from ``init_batch`` (``--no-estimate``: not started from this estimate,
  so the truth does not lean on what it checks). Its answer is the truth the estimate is held to.
  Timed the same way, with its job count.

``gpt_item`` is ``gpt`` with a value read (``.item()``) in its first block: fake tensors cannot
trace it, so the estimate runs rank 0's real CPU steps in the fake group instead (its assumptions
say so), still a fresh build per trial.

``--large`` runs no job: ``llama_large`` (1.1B parameters, built on the meta device, bf16 compute)
sharded over 8 ranks, estimated for ``memory_limit="80GiB", device="cuda"`` (the modelled caching
allocator, the CUDA context and NCCL's buffers kept aside: see the result's assumptions), timed:
what a laptop says about a cluster job; JSON ``sharded-estimate-large-*.json``.

The table shows both answers side by side, whether they are equal, and the estimate's error
where they are not (within one batch and below the truth is the issue's bar). Output: the table
and JSON under ``benchmarks/results/sharded-estimate-cpu-*.json``. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from batchfit.estimation.rank_estimate import estimate_sharded

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  (this directory, not a package)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGETS = HERE / "sharded_targets.py"
#: Per-rank limits that put each model's boundary in the tens.
LIMITS = {"gpt": "128MiB", "llama": "128MiB", "gpt_item": "128MiB"}
WORLDS = (2, 4)


def run_estimate(model: str, world: int, limit: str) -> dict[str, Any]:
    started = time.monotonic()
    result = estimate_sharded(f"{TARGETS}:{model}", world, memory_limit=limit, for_device="cpu")
    return {
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "world_size": result.world_size,
        "global_max_batch": result.global_max_batch,
        "trials": [[t.batch_size, t.kind, t.fits, t.peak_bytes] for t in result.trials],
        "wall_s": time.monotonic() - started,
    }


def run_jobs(model: str, world: int, limit: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "jobs.json"
        command = [
            sys.executable, "-m", "batchfit", "probe", f"{TARGETS}:{model}", "--nproc-per-trial", str(world),
            "--memory-limit", limit, "--no-estimate", "--json", str(out), "-q",
        ]  # fmt: skip
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True)
        wall = time.monotonic() - started
        if done.returncode != 0:
            raise RuntimeError(f"the job-per-trial probe failed:\n{done.stderr[-3000:]}")
        document = json.loads(out.read_text())
    jobs = next((int(m.group(1)) for n in document["notes"] if (m := re.search(r"\((\d+) job\(s\) started", n))), None)
    return {
        "max_batch": document["max_batch"],
        "safe_batch": document["safe_batch"],
        "world_size": document["world_size"],
        "trials": [[t["batch_size"], t["kind"], t["fits"], t["peak_bytes"]] for t in document["trials"]],
        "jobs": jobs,
        "wall_s": wall,
    }


def _large() -> dict[str, Any]:
    started = time.monotonic()
    result = estimate_sharded(f"{TARGETS}:llama_large", 8, memory_limit="80GiB", for_device="cuda")
    wall = time.monotonic() - started
    print(f"llama_large (1.1B, seq 2048, bf16 compute), 8 ranks of 80 GiB (cuda, modelled): max {result.max_batch}, "
          f"safe {result.safe_batch} per rank (global {result.global_max_batch} / {result.global_safe_batch}), "
          f"{len(result.trials)} fake trials, {wall:.1f} s")  # fmt: skip
    document = {
        "schema": "batchfit.sharded-estimate-benchmark/1",
        **compare.stamp(["--large"]),
        "machine": compare.machine(),
        "versions": compare.versions(),
        "large": {"wall_s": wall, "result": result.to_dict()},
    }
    compare.write_results(document, RESULTS, "sharded-estimate-large-cpu")
    return document


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(LIMITS), action="append")
    parser.add_argument("--world", type=int, choices=WORLDS, action="append")
    parser.add_argument("--large", action="store_true", help="only the 1.1B Llama on 8 ranks of 80 GiB (no jobs)")
    args = parser.parse_args(argv)
    if args.large:
        return _large()
    rows = []
    header = (
        f"{'model':<8} {'W':>2} {'limit':>7} | {'est max':>7} {'safe':>5} {'s':>6} | "
        f"{'jobs max':>8} {'safe':>5} {'jobs':>4} {'s':>6} | {'equal':>5}"
    )
    print(header)
    print("-" * len(header))
    for model in args.case or list(LIMITS):
        for world in args.world or list(WORLDS):
            limit = LIMITS[model]
            estimate = run_estimate(model, world, limit)
            jobs = run_jobs(model, world, limit)
            equal = (estimate["max_batch"], estimate["safe_batch"]) == (jobs["max_batch"], jobs["safe_batch"])
            rows.append({"model": model, "world_size": world, "limit": limit, "estimate": estimate, "jobs": jobs,
                         "equal": equal})  # fmt: skip
            print(
                f"{model:<8} {world:>2} {limit:>7} | {estimate['max_batch']:>7} {estimate['safe_batch']:>5} "
                f"{estimate['wall_s']:>6.1f} | {jobs['max_batch']:>8} {jobs['safe_batch']:>5} {jobs['jobs'] or 0:>4} "
                f"{jobs['wall_s']:>6.1f} | {'yes' if equal else 'NO':>5}",
                flush=True,
            )
    document = {
        "schema": "batchfit.sharded-estimate-benchmark/1",
        **compare.stamp(argv),
        "machine": compare.machine(),
        "versions": compare.versions(),
        "rows": rows,
    }
    compare.write_results(document, RESULTS, "sharded-estimate-cpu")
    return document


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
