"""The command that proves or disproves batchfit's CUDA path on a GPU machine, in two parts.

A GPU box is lent for about 15 minutes, the machine's start included, one command at a time, with
no network and nothing installed (torch and its friends are; batchfit is not: it runs from this
source tree, and the pytest plugin from ``tests/conftest.py``). Run from the repository root::

    python3 benchmarks/gpu.py --part 1 --out "$OUT/part1"   # the core; no check starts after 270 s
    python3 benchmarks/gpu.py --part 2 --out "$OUT/part2"   # allocators, frontier, compile; 240 s
    python3 benchmarks/gpu.py                                # both parts in one run (540 s)
    python3 benchmarks/gpu.py --only cap,gate                # some checks (names start with these)

Each run writes four files into ``--out`` (default ``benchmarks/results/<date>-<device>/``), so
that two parts fit the box's 8 files: ``verdict-partN.txt`` (the screen it prints),
``verdict-partN.json`` (every record), ``cuda-tests-partN.xml`` (JUnit) and ``proof-partN.tar.gz``
(everything else: the per-check JSON, every result document it read, the logs of every process it
started). Exit code 0 when every check that ran passed, 1 otherwise.

It prints a preflight first (GPU, memory, driver, torch and CUDA, a C compiler for Triton, what
``cudaMallocAsync``'s fraction reads before one is set), so that a failure reads as a cause.

The checks, each in fresh processes (``benchmarks/proof_checks.py``; the processes' code is in
``benchmarks/proof_children.py``).

Part 1, the core:

* **devices**: ``batchfit devices --json``.
* **cap native**: ``find()`` on GPT-2-small (bf16, sequence 1024) under 24 GiB, then in a *fresh*
  process a plain AdamW loop (not batchfit's trial code) under the same cap,
  ``set_per_process_memory_fraction(limit / total)``: its max must train 3 steps and max + 1 must not.
* **cuda tests**: ``pytest -m "cuda and not compile and not allocators" --require-cuda`` (JUnit),
  stopped by SIGINT at its time; a skip fails unless its reason is one of ``ALLOWED_SKIPS``.
* **estimate vs find**: ``estimate(device="cuda")`` beside that ``find()``, same model and limit.
* **gate**: ``batchfit probe --require-batch`` on a GPT whose samples dwarf the allocator's
  rounding, with and without ``--reserve auto``, at the probe's max + 1, and max + 1 from scratch.
* **throughput**: ``find()``'s samples/s and knee beside plain steady-state steps.
* **leaks**: ``leaked_bytes`` of every trial of every result above.

Part 2, what is slower or rarer:

* **cap expandable**, **cap async**: the cap check under ``expandable_segments:True`` (whose
  emulated card is stricter than a real one: torch checks the whole request against the cap
  before mapping only the missing pages) and ``backend:cudaMallocAsync``.
* **cuda tests 2**: ``pytest -m "cuda and (compile or allocators)"`` (torch.compile, fresh
  processes under each allocator).
* **frontier**: ``batchfit.frontier`` at sequence lengths 256, 512 and 1024: every point exact with
  a verified safe batch, the longest length at batch 1 found (JSON and picture kept).
* **leaks**, as in part 1.

The comparison of batchfit with Lightning and Accelerate on a GPU is ``benchmarks/gpu_compare.py``
(6-7 minutes): run it when a loan has time left after both parts.

Without CUDA it says so and runs the same checks on CPU with small models and limits (the cap
there is batchfit's own live-tensor limit, so the fresh-process check runs batchfit's own
verification trial, and says so): a smoke test of this script, run by ``.ci/run`` exactly as the
GPU box runs it, not a proof of anything on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proof_checks as pc  # noqa: E402  (this directory, not a package)
from proof_children import GATE_CPU, GATE_CUDA, run_child  # noqa: E402

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
#: The pytest marks of each part's CUDA tests (the markers are declared in pyproject.toml).
PART_MARKS = {"1": "cuda and not compile and not allocators", "2": "cuda and (compile or allocators)", "all": "cuda"}
#: Seconds after which no check starts, by part: the two parts and the box's start fit its 15 minutes.
DEADLINES = {"1": 270.0, "2": 240.0, "all": 540.0}


def plan_for(info: dict[str, Any]) -> pc.Plan:
    """What runs on this machine: GPT-2-small at 24 GiB on CUDA, small models and limits on CPU."""
    if info["cuda"]:
        total = info["gpu_total_bytes"]
        limit = 24 * GiB if total >= 26 * GiB else int(total * 0.8) // GiB * GiB
        main = pc.Case("gpt2_small", "gpt2_small", {"seq_len": 1024}, "bf16", limit)
        return pc.Plan(
            cuda=True,
            main=main,
            caps=[(name, main, allocator, conf) for name, allocator, conf in ALLOCATORS],
            gate=pc.Case("gate_gpt", "gpt", GATE_CUDA, None, 8 * GiB),
            gate_target="benchmarks/proof_children.py:gate_cuda",
            warmup=3,
            timed=10,
            # Measured on an H200 (2026-11-26): part 1's CUDA tests took 118 s, then 147 s (third
            # run), part 2's three allocator tests about 35 s each and its compile tests 28 s
            # together, before the compile-budget test (70 s) joined them.
            timeouts={
                "pytest 1": 170,
                "pytest 2": 170,
                "pytest all": 300,
                "find": 150,
                "train": 90,
                "estimate": 120,
                "throughput": 120,
                "cli": 90,
                "frontier": 150,
            },
            seq_lens=[256, 512, 1024],
        )
    gpt = {"vocab_size": 512, "seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4}
    main = pc.Case("gpt", "gpt", gpt, None, 64 * MiB)
    mlp = pc.Case("mlp", "mlp", {"in_features": 256, "hidden": 512, "depth": 3}, None, 16 * MiB)
    return pc.Plan(
        cuda=False,
        main=main,
        caps=[("cap gpt", main, "native", None), ("cap mlp", mlp, "native", None)],
        gate=pc.Case("gate_gpt", "gpt", GATE_CPU, None, 128 * MiB),
        gate_target="benchmarks/proof_children.py:gate_cpu",
        warmup=1,
        timed=2,
        timeouts={
            "pytest 1": 150,
            "pytest 2": 170,
            "pytest all": 120,
            "find": 120,
            "train": 60,
            "estimate": 120,
            "throughput": 120,
            "cli": 120,
            "frontier": 120,
        },
        seq_lens=[16, 64],
    )


def checks_of(plan: pc.Plan, part: str) -> list[tuple[str, Callable[[pc.Run], pc.Record]]]:
    """The checks of ``part`` in the order they run: the most telling first, so a deadline cuts the least."""
    caps = [(name, pc.cap_check(name, case, allocator, conf)) for name, case, allocator, conf in plan.caps]
    one = [
        ("devices", pc.devices),
        caps[0],
        ("cuda tests", pc.cuda_tests("cuda tests", PART_MARKS["1"], "pytest 1")),
        ("estimate vs find", pc.estimate_vs_find),
        ("gate", pc.gate),
        ("throughput", pc.throughput),
    ]
    two = [
        *caps[:0:-1],  # async first: its fraction is the known trap (pytorch#110194)
        ("cuda tests 2", pc.cuda_tests("cuda tests 2", PART_MARKS["2"], "pytest 2")),
        ("frontier", pc.frontier),
    ]
    if part == "all":
        one[2] = ("cuda tests", pc.cuda_tests("cuda tests", PART_MARKS["all"], "pytest all"))
        two = [check for check in two if check[0] != "cuda tests 2"]
    chosen = {"1": one, "2": two, "all": one + two}[part]
    return [*chosen, ("leaks", pc.leaks)]


def preflight(device: str) -> tuple[dict[str, Any] | None, list[str]]:
    """What this machine is, asked of fresh processes (this one never imports torch: no CUDA
    context here): ``(info, lines)``, ``info`` ``None`` when torch or batchfit cannot start.

    Two children run at once: one describes the machine, one reads the memory fraction under
    ``backend:cudaMallocAsync`` before any is set (it reads about 2e8 there: pytorch#110194).
    """
    envs = {"describe": None, "fraction": "backend:cudaMallocAsync"}  # the allocator each is started with
    started = {
        name: subprocess.Popen(
            pc.child_argv(name, {"device": device}),
            env=pc.child_env(device == "cpu", conf),
            cwd=pc.ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, conf in envs.items()
    }
    answers: dict[str, dict[str, Any]] = {}
    for name, process in started.items():
        try:
            output, _ = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            process.kill()
            output = process.communicate()[0] + "\n[no answer in 180 s]"
        answer = pc.answer_of(output) or {"ok": False, "error": output.strip()[-600:]}
        answers[name] = {**answer, "output": output[-2000:]}
    info = answers["describe"]
    if not info.get("ok"):
        return None, [f"preflight: FAILED: torch or batchfit does not start here: {info.get('error')}"]
    if device == "cuda" and not info["cuda"]:
        return None, ["preflight: FAILED: --device cuda, but torch sees no CUDA device here"]
    modules = ", ".join(f"{k} {v or 'MISSING'}" for k, v in info["modules"].items())
    lines = []
    if info["cuda"]:
        lines.append(
            f"preflight: {info['gpu']} ({info['gpu_total_bytes'] / GiB:.1f} GiB, cc {info['capability']}, "
            f"{info['gpu_count']} GPU(s)), driver {info.get('driver') or '?'}"
        )
    else:
        lines.append(f"preflight: no CUDA device: the checks run on CPU ({info['cpu']}) as a smoke test")
    build = f"CUDA {info['torch_cuda']}" if info["torch_cuda"] else "CPU build"
    lines.append(
        f"preflight: torch {info['torch']} ({build}), python {info['python']}, batchfit {info['batchfit']} "
        f"from {info['batchfit_from']}, {info['cpu_count']} CPUs"
    )
    cc = info["cc"] or "NONE (torch.compile's Triton cannot build its launchers: the compile tests will fail)"
    lines.append(f"preflight: C compiler {cc}; {modules}")
    read = answers["fraction"]
    if info["cuda"]:
        value = read.get("fraction") if read.get("ok") else f"error: {read.get('error')}"
        lines.append(
            f"preflight: under backend:cudaMallocAsync ({read.get('allocator')}) the unset memory fraction reads "
            f"{value} (above 1 means unset, pytorch#110194: batchfit writes 1.0 back, never this)"
        )
    info["async_fraction"] = {k: v for k, v in read.items() if k != "output"}
    return info, lines


def slug(info: dict[str, Any]) -> str:
    name = info.get("gpu") if info["cuda"] else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-") or "device"


def run_all(
    plan: pc.Plan, part: str, work: Path, deadline: float, only: list[str], started: float
) -> list[pc.Record]:
    run = pc.Run(plan, work, deadline, started)
    records: list[pc.Record] = []
    checks = work / "checks"
    checks.mkdir(parents=True, exist_ok=True)
    for index, (name, check) in enumerate(checks_of(plan, part), 1):
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
            print(f"[{run.elapsed():5.0f} s] {name}: {pc.status_of(record)} {record.summary}", flush=True)
        records.append(record)
        slug_name = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        (checks / f"{index:02d}-{slug_name}.json").write_text(json.dumps(record.__dict__, indent=2, default=str))
    return records


def verdict(
    info: dict[str, Any], part: str, preflight_lines: list[str], records: list[pc.Record], elapsed: float
) -> tuple[str, int]:
    """The one-screen verdict and the exit code."""
    failed = [r.name for r in records if r.passed is False]
    passed = sum(r.passed is True for r in records)
    skipped = sum(r.passed is None for r in records)
    which = "both parts" if part == "all" else f"part {part} of 2"
    lines = [f"batchfit CUDA proof, {which}, {time.strftime('%Y-%m-%d %H:%M')}, {elapsed:.0f} s", *preflight_lines, ""]
    for r in records:
        lines.append(f"{pc.status_of(r)}  {r.name:<17} {r.summary}  [{r.seconds:.0f} s]")
    lines.append("")
    tally = f"{passed} passed, {len(failed)} failed, {skipped} skipped or not applicable"
    if info["cuda"]:
        word = "DISPROVEN" if failed else "PROVEN"
        scope = "" if part == "all" else f" as far as part {part} goes"
        lines.append(
            f"verdict: CUDA path {word}{scope}: {tally}" + (f" (failed: {', '.join(failed)})" if failed else "")
        )
    else:
        word = "FAILED" if failed else "ok"
        lines.append(f"verdict: CPU smoke {word}: {tally}; the CUDA path is neither proven nor disproven here")
    return "\n".join(lines), 1 if failed else 0


def file_suffix(part: str) -> str:
    """What the names of a part's files end with (``verdict-part1.txt``), so that parts share a folder."""
    return "" if part == "all" else f"-part{part}"


def deliver(out: Path, part: str, work: Path, text: str, document: dict[str, Any]) -> list[Path]:
    """The four files of a run in ``out``: the verdict (text and JSON), the JUnit XML, and one
    tarball of everything else (a GPU box sends back at most 8 files: two parts fit)."""
    suffix = file_suffix(part)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"verdict{suffix}.txt", out / f"verdict{suffix}.json"]
    written[0].write_text(text + "\n")
    written[1].write_text(json.dumps(document, indent=2, default=str))
    junit = work / "cuda-tests.xml"
    if junit.exists():
        written.append(out / f"cuda-tests{suffix}.xml")
        shutil.copyfile(junit, written[-1])
    written.append(out / f"proof{suffix}.tar.gz")
    with tarfile.open(written[-1], "w:gz") as tar:
        tar.add(work, arcname=f"proof{suffix}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Prove or disprove batchfit's CUDA path (see the module docstring).")
    parser.add_argument("--part", choices=("1", "2", "all"), default="all", help="which part to run (default: both)")
    parser.add_argument("--deadline", type=float, help="seconds after which no check starts (270, 240, 540 by part)")
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
    deadline = args.deadline if args.deadline is not None else DEADLINES[args.part]
    info, lines = preflight(args.device)
    print("\n".join(lines), flush=True)
    if info is None:
        out = args.out or RESULTS / f"{time.strftime('%Y-%m-%d')}-unknown"
        out.mkdir(parents=True, exist_ok=True)
        text = "\n".join([*lines, "verdict: could not start"])
        (out / f"verdict{file_suffix(args.part)}.txt").write_text(text + "\n")
        return 1
    plan = plan_for(info)
    out = args.out or RESULTS / f"{time.strftime('%Y-%m-%d')}-{slug(info)}"
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    with tempfile.TemporaryDirectory(prefix="batchfit-proof-") as scratch:
        work = Path(scratch)
        records = run_all(plan, args.part, work, deadline, only, started)
        elapsed = time.monotonic() - started
        text, code = verdict(info, args.part, lines, records, elapsed)
        document = {
            "schema": "batchfit.gpu-proof/2",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "part": args.part,
            "machine": info,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "deadline_s": deadline,
            "elapsed_s": elapsed,
            "exit_code": code,
            "checks": [r.__dict__ for r in records],
            "verdict": text,
        }
        written = deliver(out, args.part, work, text, document)
    print("\n" + text + "\n\nwritten: " + ", ".join(str(p) for p in written))
    return code


if __name__ == "__main__":
    sys.exit(main())
