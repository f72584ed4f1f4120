"""The command that proves or disproves batchfit's CUDA path on a GPU machine, in one call.

A GPU box is lent for about 15 minutes, the machine's start included, one command of at most 10
minutes at a time, with no network and nothing installed (torch and its friends are; batchfit is
not: it runs from this source tree, and the pytest plugin from ``tests/conftest.py``). Run from the
repository root::

    python3 benchmarks/gpu.py --out "$OUT"        # the whole proof: every process has ended by 480 s
    python3 benchmarks/gpu.py --only cap,gate     # some checks (names start with these)
    python3 benchmarks/gpu.py --part 1            # part 1's checks of the two-part proof (gpu_bisect.sh)

It writes four files into ``--out`` (default ``benchmarks/results/<date>-<device>/``; a GPU box sends
back 8): ``verdict.txt`` (the screen it prints), ``verdict.json`` (every record, the lanes and when
each process ran), ``cuda-tests.xml`` (the JUnit XML of both pytest runs) and ``proof.tar.gz``
(everything else: the per-check JSON, every result document it read, the logs of every process it
started). With ``--part N`` the names end ``-partN``. Exit code 0 when every check that ran passed,
1 otherwise.

**Where the minutes go.** The parent never imports torch (no CUDA context here); each check runs in
a thread of it and each measurement in a fresh process. The children share the GPU in *lanes*
(``proof_checks.Lanes``): a child starts when its cap plus 2 GiB for its CUDA context fits, beside
those running, in what the preflight found free less 4 GiB. On an H200 (about 139 GiB free) that is
four 24 GiB GPT-2 children at once beside the compile tests (6 GiB) and an 8 GiB gate child; on an
H100 (about 78 GiB) two. The run has three phases:

1. *Alone*: one preflight (two processes at once, about 10 s), then ``find()`` on GPT-2 (native
   allocator) and throughput's plain loop: timed steps, which a neighbour would slow (about 35 s).
2. *Lanes*: the fresh children of the three cap checks (both sides, each allocator), ``find()``
   under expandable segments and ``cudaMallocAsync``, ``estimate()``, the gate's probe, gate runs
   and fresh children, the frontier, ``batchfit devices``, and the compile tests (``pytest -m "cuda
   and compile"``: about 110 s on the H200, the longest lane; its caps are fixed, 1-2 GiB).
3. *Alone again*: the gate with ``--reserve auto`` (about 13 s), then the CUDA tests (``pytest -m
   "cuda and not compile"``, about 130 s). Both read the whole device's free memory
   (``reserve="auto"``, a limit clipped to what is reachable, a user's fraction bounding the
   budget): another process's memory would read as theirs, so these do not run beside the children
   whatever memory allows; only the compile tests, whose caps are fixed, do.

From runs 2 and 3's times (H200): about 10 + 35 + 115 + 13 + 130 s, 5-6 minutes; on an H100 phase 2
has two lanes (about 125 s of children) and the run takes about 6 minutes. ``--deadline`` (480 s)
is the run's hard end: no process starts with less than 20 s left, and every process still running
is stopped (SIGINT, then SIGKILL 15 s later) so that all have ended by then; a check cut off there is
SKIP, never FAIL, and the verdict then says UNDECIDED, not PROVEN.

pytest runs on the files that hold ``cuda`` tests only (``proof_checks.cuda_test_files``: about 150
tests collected in 3 s, where the whole suite's 1,900 cost 22-25 s a run on the H200 to deselect),
and without the three allocator tests that repeat the cap checks (``proof_checks.DESELECTED``,
deselected by node id; the verdict says so).

**The checks** (``benchmarks/proof_checks.py``; the processes' code is ``benchmarks/proof_children.py``):

* **devices**: ``batchfit devices --json``.
* **cap native**, **cap expandable**, **cap async**: ``find()`` on GPT-2-small (bf16, sequence
  1024) under 24 GiB with the native allocator, ``expandable_segments:True`` and
  ``backend:cudaMallocAsync``, then both sides from scratch: its max and max + 1, each in a fresh
  process running 10 steps of a plain AdamW loop (not batchfit's trial code) under the same cap
  (``set_per_process_memory_fraction(limit / total)``), judged by the rule of "fits" per allocator
  (``proof_children.judge_fresh``: native, no out-of-memory and no allocator retry; expandable
  segments and ``cudaMallocAsync``, no out-of-memory, with the retries or the pool's overhead
  reported). The max must fit, max + 1 must not.
* **estimate vs find**: ``estimate(for_device="cuda")`` beside that ``find()``, same model and limit.
* **gate**: ``batchfit probe --require-batch`` on a GPT whose samples dwarf the allocator's
  rounding, at 3/4 of the probe's max with and without ``--reserve auto`` and at max + 1 (no search
  below it: ``--init-batch max + 1``), and the max and max + 1 from scratch by the same rule.
* **throughput**: ``find()``'s samples/s and knee beside plain steady-state steps.
* **frontier**: ``batchfit.frontier`` at sequence lengths 256, 512 and 1024: every point exact with
  a verified safe batch, the longest length at batch 1 found (JSON and picture kept).
* **cuda tests**, **compile tests**: the two pytest runs above (``--require-cuda``, JUnit); a skip
  fails unless its reason is one of ``proof_checks.ALLOWED_SKIPS``.
* **leaks**: ``leaked_bytes`` of every trial of every result above.

After it, in calls of their own while a loan lasts: ``benchmarks/gpu_experiment.py`` (which
definition of "fits" holds between the probe and fresh processes) and ``benchmarks/gpu_compare.py``
(batchfit beside Lightning and Accelerate, every answer judged by fresh processes).

Without CUDA it says so and runs the same checks on CPU with small models and limits (the cap
there is batchfit's own live-tensor limit, so the fresh-process check runs batchfit's own
from-scratch trial, and says so), with one core per lane: a smoke test of this script, run by
``.ci/run`` exactly as the GPU box runs it (about a minute on 2 cores), not a proof of anything on
a GPU.
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
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proof_checks as pc  # noqa: E402  (this directory, not a package)
from proof_children import GATE_CPU, GATE_CUDA, run_child  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GiB, MiB = 2**30, 2**20
#: Seconds after which every process of the run has ended (``--deadline``).
DEADLINE_S = 480.0
#: (check name, allocator, PYTORCH_CUDA_ALLOC_CONF); the first is the main case's.
ALLOCATORS = (
    ("cap native", "native", None),
    ("cap expandable", "expandable_segments", "expandable_segments:True"),
    ("cap async", "cudaMallocAsync", "backend:cudaMallocAsync"),
)
#: When a check runs: ``early`` alone and first (timed steps), ``shared`` in a thread beside the
#: others (its children in lanes; a section of it may wait to run alone), ``last`` after them all.
STAGES = {"throughput": "early", "leaks": "last"}
#: The shared checks whose threads start first, so that their children ask for lanes first: the
#: longest chains of processes (the compile tests; the gate: probe, then gate runs and fresh
#: children, then ``--reserve auto``; the caps whose ``find()`` has not run yet).
START_FIRST = ("compile tests", "gate", "cap async", "cap expandable", "cap mlp")
#: The checks of the two-part proof (``--part``), kept for ``gpu_bisect.sh``: part 1 the core.
PART_ONE = ("devices", "cap native", "cap gpt", "cuda tests", "estimate vs find", "gate", "throughput", "leaks")


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
            # Measured on an H200 (2026-11-26): the CUDA tests but compile and allocators took 118 s,
            # then 147 s with 25 s of collecting the whole suite; the compile tests 110 s together
            # (the compile-budget test 53-70 s); find() ~10 s, a fresh child ~10 s, mostly start-up.
            timeouts={
                "pytest": 240,
                "pytest compile": 220,
                "find": 150,
                "train": 90,
                "estimate": 120,
                "throughput": 120,
                "cli": 90,
                "frontier": 150,
            },
            seq_lens=[256, 512, 1024],
            capacity=pc.pool_bytes(info.get("gpu_free_bytes") or int(total * 0.95)),
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
            "pytest": 150,
            "pytest compile": 150,
            "find": 120,
            "train": 60,
            "estimate": 120,
            "throughput": 120,
            "cli": 120,
            "frontier": 120,
        },
        seq_lens=[16, 64],
        capacity=max(1, min(4, info.get("cpu_count") or 1)),  # one core a child (OMP_NUM_THREADS=1)
    )


def checks_of(plan: pc.Plan, part: str) -> list[tuple[str, Callable[[pc.Run], pc.Record]]]:
    """The checks of ``part`` in the order the verdict lists them (:data:`STAGES` says when each runs)."""
    chosen = [
        ("devices", pc.devices),
        *[(name, pc.cap_check(name, case, allocator, conf)) for name, case, allocator, conf in plan.caps],
        ("estimate vs find", pc.estimate_vs_find),
        ("gate", pc.gate),
        ("throughput", pc.throughput),
        ("frontier", pc.frontier),
        ("cuda tests", pc.cuda_tests),
        ("compile tests", pc.compile_tests),
        ("leaks", pc.leaks),
    ]
    if part == "all":
        return chosen
    return [(name, check) for name, check in chosen if (name in PART_ONE) == (part == "1") or name == "leaks"]


def preflight(device: str) -> tuple[dict[str, Any] | None, list[str]]:
    """What this machine is, asked of fresh processes (this one never imports torch: no CUDA
    context here): ``(info, lines)``, ``info`` ``None`` when torch or batchfit cannot start.

    Two children run at once: one describes the machine (its free GPU memory sizes the lanes), one
    reads the memory fraction under ``backend:cudaMallocAsync`` before any is set (it reads about
    2e8 there: pytorch#110194).
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
            f"preflight: {info['gpu']} ({info['gpu_total_bytes'] / GiB:.1f} GiB, "
            f"{(info.get('gpu_free_bytes') or 0) / GiB:.1f} GiB free, cc {info['capability']}, "
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


def lanes_line(plan: pc.Plan, info: dict[str, Any]) -> str:
    """What the children share, in words (the preflight's last line)."""
    alone = "the main find(), throughput, --reserve auto and the CUDA tests run alone"
    if not plan.cuda:
        return f"lanes: {plan.capacity} children at once, one core each; {alone}"
    cost = plan.cost(plan.main.limit_bytes)
    beside = plan.compile_cost + plan.cost(plan.gate.limit_bytes)
    free = info.get("gpu_free_bytes")
    return (
        f"lanes: {pc.size(free)} free less {pc.size(pc.POOL_MARGIN_BYTES)}: {pc.size(plan.capacity)} for the children, "
        f"{pc.at_once(plan.capacity, cost, beside)} of {plan.main.key} at once ({pc.size(cost)} each: cap and context) "
        f"beside the compile tests and a gate child; {alone}"
    )


def slug(info: dict[str, Any]) -> str:
    name = info.get("gpu") if info["cuda"] else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-") or "device"


def execute(run: pc.Run, index: int, name: str, check: Callable[[pc.Run], pc.Record]) -> pc.Record:
    """One check, timed and printed; its record also goes to ``checks/``."""
    began = time.monotonic()
    run.say(f"{name} ...")
    try:
        record = check(run)
    except pc.Cut as exc:
        record = pc.Record(name, None, f"cut off: {exc}")
    except Exception as exc:  # a bug of this script: recorded, and the run goes on
        error = f"harness error: {type(exc).__name__}: {exc}"
        record = pc.Record(name, False, error, {"traceback": traceback.format_exc()})
    record.name, record.seconds = name, time.monotonic() - began
    run.say(f"{name}: {pc.status_of(record)} {record.summary}")
    write_record(run, index, record)
    return record


def write_record(run: pc.Run, index: int, record: pc.Record) -> None:
    slug_name = re.sub(r"[^a-z0-9]+", "-", record.name.lower()).strip("-")
    path = run.out / "checks" / f"{index:02d}-{slug_name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record.__dict__, indent=2, default=str))


def run_all(plan: pc.Plan, part: str, work: Path, deadline: float, only: list[str], started: float) -> Any:
    """Every chosen check, in its stage (:data:`STAGES`): ``(records in the verdict's order, run)``."""
    run = pc.Run(plan, work, deadline, started)
    chosen = checks_of(plan, part)
    picked = {name for name, _ in chosen if not only or any(name.startswith(prefix) for prefix in only)}
    records: dict[str, pc.Record] = {name: pc.Record(name, None, "not selected (--only)") for name, _ in chosen}
    index = {name: i for i, (name, _) in enumerate(chosen, 1)}

    def stage(which: str) -> list[tuple[str, Callable[[pc.Run], pc.Record]]]:
        return [(n, c) for n, c in chosen if n in picked and STAGES.get(n, "shared") == which]

    # 1. Alone: the main case's find(), whose trials' samples/s throughput reads, then throughput.
    if picked & {plan.caps[0][0], "estimate vs find", "throughput"}:
        try:
            pc.run_find(run, plan.main, "native", None)
        except pc.Cut:
            pass  # its checks say so when they ask again
    for name, check in stage("early"):
        records[name] = execute(run, index[name], name, check)
    # 2. Each check in a thread; their children wait for lanes, their alone sections for the rest.
    shared = sorted(stage("shared"), key=lambda item: START_FIRST.index(item[0]) if item[0] in START_FIRST else 99)
    run.lanes.workers = len(shared)

    def work_on(name: str, check: Callable[[pc.Run], pc.Record]) -> None:
        try:
            records[name] = execute(run, index[name], name, check)
        finally:
            run.lanes.done()

    threads = [threading.Thread(target=work_on, args=item, name=item[0], daemon=True) for item in shared]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # 3. What reads the others' results.
    for name, check in stage("last"):
        records[name] = execute(run, index[name], name, check)
    for name, _ in chosen:
        if name not in picked:
            write_record(run, index[name], records[name])
    return [records[name] for name, _ in chosen], run


def verdict(
    info: dict[str, Any],
    part: str,
    only: list[str],
    preflight_lines: list[str],
    records: list[pc.Record],
    run: pc.Run,
    elapsed: float,
) -> tuple[str, int]:
    """The one-screen verdict and the exit code."""
    failed = [r.name for r in records if r.passed is False]
    passed = sum(r.passed is True for r in records)
    unselected = [r.name for r in records if r.passed is None and r.summary.startswith("not selected")]
    undecided = [r.name for r in records if r.passed is None and r.name not in unselected]
    which = "the whole proof" if part == "all" and not only else "some checks" if only else f"part {part}'s checks"
    stamp = time.strftime("%Y-%m-%d %H:%M")
    lines = [f"batchfit CUDA proof, {which}, {stamp}, {elapsed:.0f} s", *preflight_lines, ""]
    for r in records:
        lines.append(f"{pc.status_of(r)}  {r.name:<17} {r.summary}  [{r.seconds:.0f} s]")
    held, at_once = run.lanes.peak[1], run.lanes.peak[0]
    unit = pc.size(held) if run.plan.cuda else f"{held} cores"
    lines += ["", f"processes: {len(run.timeline)} started, at most {at_once} at once in the lanes ({unit})"]
    tally = f"{passed} passed, {len(failed)} failed, {len(undecided)} skipped or not applicable"
    tally += f", {len(unselected)} not selected" if unselected else ""
    if info["cuda"]:
        if failed:
            word = "DISPROVEN"
        elif [name for name in undecided if name != "leaks"]:
            word = "UNDECIDED (a check did not finish)"
        else:
            word = "PROVEN" + ("" if which == "the whole proof" else f" as far as {which} go")
        lines.append(f"verdict: CUDA path {word}: {tally}" + (f" (failed: {', '.join(failed)})" if failed else ""))
    else:
        word = "FAILED" if failed else "ok"
        lines.append(f"verdict: CPU smoke {word}: {tally}; the CUDA path is neither proven nor disproven here")
    return "\n".join(lines), 1 if failed else 0


def file_suffix(part: str) -> str:
    """What the names of a part's files end with (``verdict-part1.txt``), so that parts share a folder."""
    return "" if part == "all" else f"-part{part}"


def deliver(out: Path, part: str, work: Path, text: str, document: dict[str, Any]) -> list[Path]:
    """The four files of a run in ``out``: the verdict (text and JSON), the JUnit XML of both pytest
    runs, and one tarball of everything else (a GPU box sends back at most 8 files)."""
    suffix = file_suffix(part)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"verdict{suffix}.txt", out / f"verdict{suffix}.json"]
    written[0].write_text(text + "\n")
    written[1].write_text(json.dumps(document, indent=2, default=str))
    reports = [path for path in (work / "cuda-tests.xml", work / "compile-tests.xml") if path.exists()]
    if reports:
        written.append(out / f"cuda-tests{suffix}.xml")
        try:
            pc.merge_junit(reports, written[-1])
        except Exception:  # a report cut short: the first as it is (both are in the tarball)
            shutil.copyfile(reports[0], written[-1])
    written.append(out / f"proof{suffix}.tar.gz")
    with tarfile.open(written[-1], "w:gz") as tar:
        tar.add(work, arcname=f"proof{suffix}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Prove or disprove batchfit's CUDA path (see the module docstring).")
    parser.add_argument(
        "--part", choices=("1", "2", "all"), default="all", help="the old part 1 or 2's checks (default: all)"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=DEADLINE_S,
        help=f"seconds by which every process has ended ({DEADLINE_S:.0f})",
    )
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
    info, lines = preflight(args.device)
    if info is None:
        print("\n".join(lines), flush=True)
        out = args.out or RESULTS / f"{time.strftime('%Y-%m-%d')}-unknown"
        out.mkdir(parents=True, exist_ok=True)
        text = "\n".join([*lines, "verdict: could not start"])
        (out / f"verdict{file_suffix(args.part)}.txt").write_text(text + "\n")
        return 1
    plan = plan_for(info)
    lines.append(lanes_line(plan, info))
    print("\n".join(lines), flush=True)
    out = args.out or RESULTS / f"{time.strftime('%Y-%m-%d')}-{slug(info)}"
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    with tempfile.TemporaryDirectory(prefix="batchfit-proof-") as scratch:
        work = Path(scratch)
        records, run = run_all(plan, args.part, work, args.deadline, only, started)
        elapsed = time.monotonic() - started
        text, code = verdict(info, args.part, only, lines, records, run, elapsed)
        document = {
            "schema": "batchfit.gpu-proof/3",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "part": args.part,
            "only": only,
            "machine": info,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "deadline_s": args.deadline,
            "elapsed_s": elapsed,
            "exit_code": code,
            "lanes": {"capacity": plan.capacity, "cuda": plan.cuda, "peak": run.lanes.peak},
            "timeline": sorted(run.timeline, key=lambda entry: entry["start_s"]),
            "checks": [r.__dict__ for r in records],
            "verdict": text,
        }
        written = deliver(out, args.part, work, text, document)
    print("\n" + text + "\n\nwritten: " + ", ".join(str(p) for p in written))
    return code


if __name__ == "__main__":
    sys.exit(main())
