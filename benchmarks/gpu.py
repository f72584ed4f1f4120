"""The one command that proves or disproves batchfit's CUDA path on a GPU machine.

Run from the repository root, on the GPU box first thing (about 5-8 minutes on one H100, an
estimate until it has run there)::

    python benchmarks/gpu.py                   # every check; nothing starts after 540 s
    python benchmarks/gpu.py --deadline 300    # fewer checks when time is short (the rest say SKIP)
    python benchmarks/gpu.py --quick           # the CPU smoke run of CI (under a minute on 2 cores)
    python benchmarks/gpu.py --only cap,gate   # some checks (names start with these)
    python benchmarks/gpu.py --only frontier   # the frontier of GPT-2-small (SDPA, bf16) alone

It writes ``benchmarks/results/<YYYY-MM-DD>-<device>/`` (``--out`` overrides): ``verdict.txt``
(the screen it prints), ``verdict.json`` (every record), ``checks/NN-<name>.json`` (one per
check), ``cuda-tests.xml`` (JUnit), ``devices.json``, every ``find()``/``estimate()``/gate
result it read, and ``logs/`` (the output of every process it started). Exit code 0 when every
check that ran passed, 1 otherwise.

The checks, each in fresh processes (``benchmarks/proof_checks.py``; the processes' code is in
``benchmarks/proof_children.py``):

* **cuda tests**: ``pytest -m cuda --require-cuda`` (JUnit XML).
* **devices**: ``batchfit devices --json``.
* **cap <allocator>**: ``find()`` on GPT-2-small (bf16, sequence 1024) under 24 GiB, then in a
  *fresh* process a plain AdamW loop (not batchfit's trial code) under the same cap,
  ``set_per_process_memory_fraction(limit / total)``: its max must train 3 steps and max + 1 must
  not. Under the native allocator, ``expandable_segments:True`` and ``backend:cudaMallocAsync``.
* **estimate vs find**: ``estimate(device="cuda")`` beside that ``find()``, same model and limit.
* **throughput**: ``find()``'s samples/s and knee beside plain steady-state steps (warm-up, then
  synchronised timed steps) at its smallest timed size, knee, best and max.
* **gate**: ``batchfit probe --require-batch`` on the built-in GPT at 4 GiB, with and without
  ``--reserve auto``, and at the probe's max + 1.
* **leaks**: ``leaked_bytes`` of every trial of every result above.
* **frontier**: ``batchfit.frontier`` on that model at sequence lengths 256, 512 and 1024: every
  point exact with a verified safe batch, the longest length at batch 1 found; its JSON and
  picture are kept to commit. (The gradient noise scale is not measured by batchfit yet.)

The comparison of batchfit with Lightning and Accelerate on a GPU is ``benchmarks/gpu_compare.py``;
it measures finders against a scan made the same way under the same cap, so it cannot see an
error they share: run this first.

Without CUDA it says so and runs the same checks on CPU with small models and limits (the cap
there is batchfit's own live-tensor limit, so the fresh-process check runs batchfit's own
verification trial, and says so): a smoke test of this script, not a proof of anything on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proof_checks as pc  # noqa: E402  (this directory, not a package)
from proof_children import run_child  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: Checks that start no process (they read what the others wrote): they run after the deadline too.
FREE = ("leaks",)
GiB, MiB = 2**30, 2**20
#: (check name, allocator, PYTORCH_CUDA_ALLOC_CONF); the first is the main case's.
ALLOCATORS = (
    ("cap native", "native", None),
    ("cap expandable", "expandable_segments", "expandable_segments:True"),
    ("cap async", "cudaMallocAsync", "backend:cudaMallocAsync"),
)


def plan_for(info: dict[str, Any], quick: bool) -> pc.Plan:
    """What runs on this machine: GPT-2-small at 24 GiB on CUDA, small models and limits on CPU."""
    if info["cuda"]:
        total = info["gpu_total_bytes"]
        limit = 24 * GiB if total >= 26 * GiB else int(total * 0.8) // GiB * GiB
        main = pc.Case("gpt2_small", "gpt2_small", {"seq_len": 1024}, "bf16", limit)
        allocators = ALLOCATORS[:1] if quick else ALLOCATORS
        return pc.Plan(
            cuda=True,
            quick=quick,
            main=main,
            caps=[(name, main, allocator, conf) for name, allocator, conf in allocators],
            gate={"target": "batchfit.examples:gpt", "limit": "4GiB", "require": 1024},
            warmup=3,
            timed=10,
            timeouts={
                "pytest": 300,
                "find": 240,
                "train": 150,
                "estimate": 240,
                "throughput": 180,
                "cli": 180,
                "frontier": 300,
            },
            seq_lens=[256, 512, 1024],
        )
    gpt = {"vocab_size": 512, "seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4}
    main = pc.Case("gpt", "gpt", gpt, None, 64 * MiB)
    caps = [("cap gpt", main, "native", None)]
    if not quick:
        mlp = pc.Case("mlp", "mlp", {"in_features": 256, "hidden": 512, "depth": 3}, None, 16 * MiB)
        caps.append(("cap mlp", mlp, "native", None))
    return pc.Plan(
        cuda=False,
        quick=quick,
        main=main,
        caps=caps,
        gate={"target": "batchfit.examples:gpt", "limit": "128MiB", "require": 64},
        warmup=1,
        timed=2 if quick else 4,
        timeouts={
            "pytest": 240,
            "find": 120,
            "train": 60,
            "estimate": 120,
            "throughput": 120,
            "cli": 120,
            "frontier": 120,
        },
        seq_lens=[16, 64] if quick else [16, 32, 64],
    )


def checks_of(plan: pc.Plan) -> list[tuple[str, Callable[[pc.Run], pc.Record]]]:
    """The checks in the order they run: the most telling first, so a deadline cuts the least."""
    caps = [(name, pc.cap_check(name, case, allocator, conf)) for name, case, allocator, conf in plan.caps]
    return [
        ("devices", pc.devices),
        ("cuda tests", pc.cuda_tests),
        caps[0],
        ("estimate vs find", pc.estimate_vs_find),
        ("throughput", pc.throughput),
        ("gate", pc.gate),
        *caps[1:],
        ("frontier", pc.frontier),
        ("leaks", pc.leaks),
    ]


def describe(device: str) -> dict[str, Any]:
    """Ask a fresh process what torch sees (this one never imports torch: no CUDA context here)."""
    import subprocess

    from proof_children import MARK

    argv = [sys.executable, __file__, "--child", "describe", "--args", json.dumps({"device": device})]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=pc.ROOT)
    marked = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if not marked:
        raise SystemExit(f"could not start torch in a child process:\n{done.stdout}{done.stderr}")
    info = json.loads(marked[-1][len(MARK) :])
    if device == "cuda" and not info["cuda"]:
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    return info


def slug(info: dict[str, Any]) -> str:
    name = info.get("gpu") if info["cuda"] else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-") or "device"


def run_all(plan: pc.Plan, out: Path, deadline: float, only: list[str], started: float) -> list[pc.Record]:
    run = pc.Run(plan, out, deadline, started)
    records: list[pc.Record] = []
    checks = out / "checks"
    checks.mkdir(parents=True, exist_ok=True)
    for old in checks.glob("*.json"):  # this run's records only, never a stale one beside them
        old.unlink()
    for index, (name, check) in enumerate(checks_of(plan), 1):
        began = time.monotonic()
        if only and not any(name.startswith(prefix) for prefix in only):
            record = pc.Record(name, None, "not selected (--only)")
        elif run.elapsed() > deadline and name not in FREE:
            late = f"skipped: would start at {run.elapsed():.0f} s, after --deadline {deadline:.0f}"
            record = pc.Record(name, None, late)
        else:
            print(f"[{run.elapsed():5.0f} s] {name} ...", flush=True)
            try:
                record = check(run)
            except pc.Cut as exc:
                record = pc.Record(name, None, f"cut off: {exc}")
            except Exception as exc:  # a bug of this script: recorded, and the run goes on
                import traceback

                error = f"harness error: {type(exc).__name__}: {exc}"
                record = pc.Record(name, False, error, {"traceback": traceback.format_exc()})
            record.name, record.seconds = name, time.monotonic() - began
        records.append(record)
        slug_name = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        (checks / f"{index:02d}-{slug_name}.json").write_text(json.dumps(record.__dict__, indent=2, default=str))
    return records


def verdict(info: dict[str, Any], plan: pc.Plan, records: list[pc.Record], elapsed: float) -> tuple[str, int]:
    """The one-screen verdict and the exit code."""
    failed = [r.name for r in records if r.passed is False]
    passed = sum(r.passed is True for r in records)
    skipped = sum(r.passed is None for r in records)
    where = f"{info['gpu']} ({info['gpu_total_bytes'] / GiB:.1f} GiB)" if info["cuda"] else f"CPU ({info['cpu']})"
    build = f"CUDA {info['torch_cuda']}" if info["torch_cuda"] else "CPU build"
    lines = [
        f"batchfit CUDA proof, {time.strftime('%Y-%m-%d %H:%M')}: {where}, {info['cpu_count']} CPUs",
        f"torch {info['torch']} ({build}), batchfit {info['batchfit']}, python {info['python']}"
        f", {'quick' if plan.quick else 'full'} run, {elapsed:.0f} s",
    ]
    if not plan.cuda:
        lines.append("NO CUDA: the same checks ran on CPU (small models, live-tensor limits) as a smoke test.")
    lines.append("")
    for r in records:
        status = "SKIP" if r.passed is None else ("PASS" if r.passed else "FAIL")
        lines.append(f"{status}  {r.name:<17} {r.summary}  [{r.seconds:.0f} s]")
    lines.append("")
    tally = f"{passed} passed, {len(failed)} failed, {skipped} skipped or not applicable"
    if plan.cuda:
        word = "DISPROVEN" if failed else ("PROVEN" if not plan.quick else "PROVEN as far as --quick goes")
        lines.append(f"verdict: CUDA path {word}: {tally}" + (f" (failed: {', '.join(failed)})" if failed else ""))
    else:
        word = "FAILED" if failed else "ok"
        lines.append(f"verdict: CPU smoke {word}: {tally}; the CUDA path is neither proven nor disproven here")
    lines.append("noise scale: not yet")
    return "\n".join(lines), 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Prove or disprove batchfit's CUDA path (see the module docstring).")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds after which no check starts (540)")
    parser.add_argument("--quick", action="store_true", help="the CPU smoke run for CI: one small case, fewer steps")
    parser.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<date>-<device>/)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="cpu: the CPU run anywhere")
    parser.add_argument("--only", default="", help="comma-separated prefixes of check names to run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--args", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args.child, args.args)
        return 0
    started = time.monotonic()
    info = describe(args.device)
    if not info["cuda"]:
        print("no CUDA: torch sees no CUDA device; running the same checks on CPU as a smoke test", flush=True)
    plan = plan_for(info, args.quick)
    out = args.out or RESULTS / f"{time.strftime('%Y-%m-%d')}-{slug(info)}"
    out.mkdir(parents=True, exist_ok=True)
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    records = run_all(plan, out, args.deadline, only, started)
    elapsed = time.monotonic() - started
    text, code = verdict(info, plan, records, elapsed)
    document = {
        "schema": "batchfit.gpu-proof/1",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "quick": args.quick,
        "deadline_s": args.deadline,
        "elapsed_s": elapsed,
        "exit_code": code,
        "checks": [r.__dict__ for r in records],
        "verdict": text,
    }
    (out / "verdict.json").write_text(json.dumps(document, indent=2, default=str))
    (out / "verdict.txt").write_text(text + "\n")
    print("\n" + text + f"\n\nwritten to {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
