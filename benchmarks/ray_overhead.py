"""What Ray Train costs a probe: the same find() in one process, under torchrun, and in a TorchTrainer.

Run from the repository root (Ray Train is optional: without it the Ray row says it was skipped)::

    python benchmarks/ray_overhead.py                 # gpt@64MiB, 3 repeats, about 2-3 minutes on 2 cores
    python benchmarks/ray_overhead.py --repeats 1 --limit 32MiB

The same probe, three ways, each a fresh job per repeat (so every find() is a first one, with its
first-use costs, as in a real run), each process on one torch thread (``OMP_NUM_THREADS=1``, what
torchrun and Ray give a CPU worker):

* **one process**: ``python -m batchfit probe batchfit.examples:gpt --memory-limit LIMIT --json``;
* **torchrun**: the same command under ``torchrun --standalone --nproc-per-node 2`` (gloo, the
  model wrapped in DDP by the CLI);
* **Ray Train**: a ``TorchTrainer`` with 2 CPU workers on a local Ray cluster started once
  (``ray.init``, timed apart); ``train_func`` builds the same model, wraps it with
  ``ray.train.torch.prepare_model`` (DDP) and calls ``batchfit.find()``.

Per way: the answer (max and safe batch: they must agree), ``find()``'s own wall time
(``Result.elapsed_s``, rank 0) and the job's wall time (process start to exit; for Ray,
``trainer.fit()``, i.e. worker group start, process group set-up, the probe and the tear-down).
The Ray overhead is the difference to torchrun: in ``find()`` (the meetings are the same gloo
collectives, so it should be none) and in the job (Ray's controller and worker actors). Medians
over the repeats. Output: a table on stdout and JSON under ``benchmarks/results/ray_overhead-cpu-*.json``.
Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402  (this directory, not a package)
import torch  # noqa: E402

import batchfit  # noqa: E402
import batchfit.ray  # noqa: E402  (its install hint; it imports no ray)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TARGET = "batchfit.examples:gpt"
WORKERS = 2
JOB_TIMEOUT_S = 300


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def cli_job(limit: str, nproc: int) -> dict[str, Any]:
    """``batchfit probe`` in a fresh process (``nproc`` 1) or under torchrun with ``nproc`` ranks."""
    with tempfile.TemporaryDirectory() as out:
        document = Path(out, "result.json")
        probe = ["-m", "batchfit", "probe", TARGET, "--memory-limit", limit, "--quiet", "--json", str(document)]
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, *launcher, *probe],
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
            cwd=out,
            env=_env(),
        )
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"{'torchrun' if nproc > 1 else 'one process'} failed:\n{done.stderr[-3000:]}")
        result = json.loads(document.read_text())
    return {
        "job_wall_s": wall,
        "find_s": result["elapsed_s"],
        "max_batch": result["max_batch"],
        "safe_batch": result["safe_batch"],
        "world_size": result["world_size"],
        "trials": len(result["trials"]),
    }


def _train_func(config: dict[str, Any]) -> None:
    """On every Ray Train worker: the CLI target's model, wrapped by Ray, probed by find()."""
    import ray.train
    import ray.train.torch

    from batchfit.examples import gpt

    started = time.perf_counter()
    model, sample = gpt()
    model = ray.train.torch.prepare_model(model)
    result = batchfit.find(model, sample, memory_limit=config["limit"])
    record = {
        "find_s": result.elapsed_s,
        "train_func_s": time.perf_counter() - started,
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "world_size": result.world_size,
        "trials": len(result.trials),
    }
    Path(config["out"], f"rank{ray.train.get_context().get_world_rank()}.json").write_text(json.dumps(record))


def ray_job(limit: str) -> dict[str, Any]:
    """One ``TorchTrainer.fit()`` with 2 CPU workers on the running local cluster."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory() as out:
        trainer = TorchTrainer(
            _train_func,
            train_loop_config={"limit": limit, "out": out},
            scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
            run_config=RunConfig(storage_path=out, name="probe", failure_config=FailureConfig(max_failures=0)),
        )
        started = time.perf_counter()
        trainer.fit()
        wall = time.perf_counter() - started
        ranks = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(WORKERS)]
    if len({(r["max_batch"], r["safe_batch"]) for r in ranks}) != 1:
        raise RuntimeError(f"the Ray workers disagree: {ranks}")
    return {**ranks[0], "job_wall_s": wall, "ranks": ranks}


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", default="64MiB", help="the live-tensor limit of every probe (default 64MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh jobs per way (default 3); medians are shown")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON file")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    has_ray = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.train") is not None
    meta = {
        **compare.stamp(argv),
        "machine": compare.machine(),
        "versions": {
            "torch": torch.__version__,
            "batchfit": batchfit.__version__,
            "ray": importlib.import_module("ray").__version__ if has_ray else None,
        },
        "target": TARGET,
        "limit": args.limit,
        "workers": WORKERS,
        "repeats": args.repeats,
    }
    machine = meta["machine"]
    print(f"batchfit Ray overhead: {machine['cpu']}, {machine['cores']} cores; {meta['versions']}")
    print(f"{TARGET} under {args.limit}, {args.repeats} fresh job(s) per way, 1 torch thread per process")
    ways: dict[str, list[dict[str, Any]]] = {"one process": [], "torchrun x2": [], "Ray Train x2": []}
    ray_init_s = None
    skipped = None
    for repeat in range(args.repeats):
        ways["one process"].append(cli_job(args.limit, 1))
        ways["torchrun x2"].append(cli_job(args.limit, WORKERS))
        print(f"repeat {repeat + 1}: one process and torchrun done")
    if has_ray:
        import ray

        started = time.perf_counter()
        ray.init(
            num_cpus=WORKERS,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {k: v for k, v in _env().items() if k in ("PYTHONPATH", "OMP_NUM_THREADS")}},
        )
        ray_init_s = time.perf_counter() - started
        try:
            for repeat in range(args.repeats):
                ways["Ray Train x2"].append(ray_job(args.limit))
                print(f"repeat {repeat + 1}: Ray Train done")
        finally:
            ray.shutdown()
    else:
        skipped = f"Ray Train is not installed ({batchfit.ray.INSTALL_HINT})"
        del ways["Ray Train x2"]

    print(f"\n{'way':<14} {'max':>4} {'safe':>5} {'trials':>6} {'find() s':>9} {'job s':>7} {'job - find s':>13}")
    summary: dict[str, dict[str, float]] = {}
    for way, runs in ways.items():
        find_s, job_s = _median(runs, "find_s"), _median(runs, "job_wall_s")
        summary[way] = {"find_s": find_s, "job_wall_s": job_s}
        first = runs[0]
        print(f"{way:<14} {first['max_batch']:>4} {first['safe_batch']:>5} {first['trials']:>6} {find_s:>9.2f} "
              f"{job_s:>7.2f} {job_s - find_s:>13.2f}")  # fmt: skip
    answers = {(runs[0]["max_batch"], runs[0]["safe_batch"]) for runs in ways.values()}
    print(f"answers agree: {len(answers) == 1} {sorted(answers)}")
    if ray_init_s is not None:
        ray_way, torchrun = summary["Ray Train x2"], summary["torchrun x2"]
        print(f"ray.init() (once, before the first fit): {ray_init_s:.2f} s")
        find_extra, job_extra = (ray_way[key] - torchrun[key] for key in ("find_s", "job_wall_s"))
        print(
            f"Ray over torchrun: find() {find_extra:+.2f} s ({ray_way['find_s'] / torchrun['find_s']:.2f}x), "
            f"job {job_extra:+.2f} s ({ray_way['job_wall_s'] / torchrun['job_wall_s']:.2f}x)"
        )
    else:
        print(f"Ray Train skipped: {skipped}")
    document = {
        "schema": "batchfit.benchmark/1",
        **meta,
        "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "ray_init_s": ray_init_s,
        "skipped": skipped,
        "answers_agree": len(answers) == 1,
        "median": summary,
        "runs": ways,
    }
    if not args.no_json:
        compare.write_results(document, args.out, "ray_overhead-cpu")
    return document


if __name__ == "__main__":
    main()
