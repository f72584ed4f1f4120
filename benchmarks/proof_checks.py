"""The checks of ``benchmarks/gpu.py``: each runs fresh processes and returns one :class:`Record`.

The parent process never imports torch, so it holds no CUDA context and no GPU memory that a
child's cap or ``--reserve auto`` would have to share. Every child has a timeout, clipped to the
run's hard end (the deadline plus a grace); a check that its child left unanswered because the
hard end came says so and counts as not run, not as failed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proof_children import MARK

ROOT = Path(__file__).resolve().parent.parent
GPU_PY = Path(__file__).resolve().parent / "gpu.py"
#: Seconds a check may run past ``--deadline`` before its child is stopped.
GRACE_S = 45.0
#: ``estimate max / find max`` inside this band passes (above 1, the estimate promises sizes
#: that did not train).
ESTIMATE_BAND = (0.85, 1.05)
#: On CUDA: ``find()``'s samples/s at its best size over a plain loop's must lie in this band,
#: and the plain loop at ``find()``'s knee must reach :data:`KNEE_SHARE` of the plain best.
RATE_BAND = (0.67, 1.5)
KNEE_SHARE = 0.9


@dataclass(frozen=True)
class Case:
    """A model of ``batchfit.examples`` and the limit it is probed under."""

    key: str
    factory: str
    kwargs: dict[str, Any]
    amp: str | None
    limit_bytes: int

    @property
    def limit_text(self) -> str:
        return f"{self.key}{' ' + self.amp if self.amp else ''} @ {size(self.limit_bytes)}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "factory": self.factory,
            "kwargs": self.kwargs,
            "amp": self.amp,
            "limit_bytes": self.limit_bytes,
        }


@dataclass
class Plan:
    """What runs here: the main case (estimate, throughput), the caps checked, the gate, timings."""

    cuda: bool
    quick: bool
    main: Case
    caps: list[tuple[str, Case, str, str | None]]  # (check name, case, allocator, PYTORCH_CUDA_ALLOC_CONF)
    gate: dict[str, Any]
    warmup: int
    timed: int
    timeouts: dict[str, float]
    seq_lens: list[int] = field(default_factory=list)  # the frontier's lengths


@dataclass
class Record:
    """One check: ``passed`` is ``None`` when it did not run or does not apply here."""

    name: str
    passed: bool | None
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def fresh(path: Path) -> Path:
    """``path`` with what an earlier run left there removed, so a stale file is never read as this run's."""
    path.unlink(missing_ok=True)
    return path


class Cut(Exception):
    """A child was stopped at the run's hard end: the check did not finish, it did not fail."""


class Run:
    """What the checks share: the plan, the output folder, the clock and the documents written."""

    def __init__(self, plan: Plan, out: Path, deadline_s: float, started: float) -> None:
        self.plan, self.out, self.started = plan, out, started
        self.deadline_s, self.hard_end = deadline_s, started + deadline_s + GRACE_S
        self.finds: dict[str, Path] = {}  # find() results by case key
        self.documents: list[tuple[str, Path]] = []  # every result document, for the leak check
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def env(self, alloc_conf: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.pop("PYTORCH_ALLOC_CONF", None)
        if alloc_conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
        if not self.plan.cuda:  # the CPU run (--device cpu on a GPU box too): no child sees a GPU
            env["CUDA_VISIBLE_DEVICES"] = ""
            # One thread: on shared cores torch's OpenMP threads wait on each other and one busy
            # neighbour makes steps many times slower, in find() and the plain loop unequally.
            env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        return env

    def command(self, argv: list[str], log: str, timeout: float, alloc_conf: str | None = None) -> tuple[int, str]:
        """Run ``argv`` with a timeout; ``(exit code, output)``; the output also goes to ``logs/``."""
        left = self.hard_end - time.monotonic()
        if left < 5:
            raise Cut(f"{log}: no time left before the hard end")
        limit = min(timeout, left)
        env = self.env(alloc_conf)
        # A session of its own, so that a timeout stops its children too (pytest starts some).
        with subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        ) as process:
            try:
                output, _ = process.communicate(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                output, _ = process.communicate()
                (self.logs / f"{log}.log").write_text(" ".join(argv) + "\n" + output + "\n[timed out]\n")
                if timeout > left:
                    raise Cut(f"{log}: stopped at the hard end (deadline + {GRACE_S:.0f} s)") from None
                return 124, output + f"\n[timed out after {timeout:.0f} s]"
        (self.logs / f"{log}.log").write_text(" ".join(argv) + "\n" + output)
        return process.returncode, output

    def child(self, name: str, args: dict[str, Any], log: str, alloc_conf: str | None = None) -> dict[str, Any]:
        """A fresh process running ``proof_children.CHILDREN[name]``; its answer, or ``ok: False``."""
        args = {"device": "cuda" if self.plan.cuda else "cpu", **args}
        argv = [sys.executable, str(GPU_PY), "--child", name, "--args", json.dumps(args)]
        rc, output = self.command(argv, log, self.plan.timeouts.get(name, 300), alloc_conf)
        marked = [line for line in output.splitlines() if line.startswith(MARK)]
        if marked:
            answer = json.loads(marked[-1][len(MARK) :])
        else:
            answer = {"ok": False, "error": f"exit {rc}, no answer: {output.strip()[-300:]}"}
        answer["exit_code"] = rc
        return answer


# The checks ---------------------------------------------------------------------------------------
def cuda_tests(run: Run) -> Record:
    """``pytest -m cuda --require-cuda`` with JUnit XML; on CPU the same collection, all skipped."""
    if not run.plan.cuda and run.plan.quick:
        return Record("cuda tests", None, "no CUDA: not run (--quick)")
    xml = fresh(run.out / "cuda-tests.xml")
    argv = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    argv += ["--require-cuda"] if run.plan.cuda else []
    rc, output = run.command(argv, "cuda-tests", run.plan.timeouts["pytest"])
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    if xml.exists():
        root = ElementTree.parse(xml).getroot()
        for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
        for case in root.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    details = {"exit_code": rc, **counts, "failed": failed, "junit_xml": xml.name, "tail": output[-1500:]}
    ran = counts["tests"] - counts["skipped"]
    if not run.plan.cuda:
        ok = rc == 0 and counts["failures"] + counts["errors"] == 0
        summary = f"no CUDA: {counts['tests']} collected, {counts['skipped']} skipped (JUnit XML written)"
        return Record("cuda tests", None if ok else False, summary, details)
    ok = rc == 0 and ran > 0 and not failed and counts["skipped"] == 0
    summary = f"{ran} ran, {len(failed)} failed, {counts['skipped']} skipped (exit {rc})"
    return Record("cuda tests", ok, summary + (f": {', '.join(failed[:3])}" if failed else ""), details)


def devices(run: Run) -> Record:
    """``batchfit devices --json``: the GPUs NVML sees (on CPU: that it says there are none)."""
    path = fresh(run.out / "devices.json")
    rc, output = run.command([sys.executable, "-m", "batchfit", "devices", "--json", str(path)], "devices", 60)
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return Record("devices", False, f"exit {rc}, no JSON: {exc}", {"exit_code": rc, "tail": output[-800:]})
    gpus = document.get("gpus") or []
    details = {"exit_code": rc, "gpus": len(gpus), "unavailable": document.get("unavailable")}
    if run.plan.cuda:
        names = ", ".join(sorted({str(g.get("name")) for g in gpus}))
        return Record("devices", rc == 0 and bool(gpus), f"{len(gpus)} GPU(s): {names or 'none listed'}", details)
    why = str(document.get("unavailable") or "")
    said = f"{len(gpus)} GPU(s) listed" if gpus else f"no GPU listed: {why[:60]}{'...' if len(why) > 60 else ''}"
    return Record("devices", rc == 0, said, details)


def run_find(run: Run, case: Case, allocator: str, conf: str | None) -> dict[str, Any]:
    """``find()`` in a fresh process; its result is kept for the checks after it."""
    key = f"{case.key}-{allocator}"
    path = fresh(run.out / f"find-{key}.json")
    answer = run.child("find", {"case": case.as_dict(), "out": str(path)}, f"find-{key}", conf)
    if answer.get("ok"):
        run.finds[key] = path
        run.documents.append((f"find {key}", path))
    return answer


def cap_check(name: str, case: Case, allocator: str, conf: str | None) -> Any:
    """The cap's honesty: ``find()``'s max trains in a fresh process under the same cap, max + 1 does not."""

    def check(run: Run) -> Record:
        found = run_find(run, case, allocator, conf)
        details: dict[str, Any] = {"case": case.as_dict(), "alloc_conf": conf, "find": found}
        if not found.get("ok"):
            return Record(name, False, f"find() failed: {found.get('error')}", details)
        top = found["max_batch"]
        wanted = {"native": "native", "cudaMallocAsync": "cudaMallocAsync"}.get(allocator)
        if run.plan.cuda and wanted and found.get("allocator") != wanted:
            return Record(name, False, f"the child ran allocator {found.get('allocator')}, not {wanted}", details)
        tries = {top: True} | ({top + 1: False} if found["boundary_reached"] else {})
        verdicts = []
        for batch, expected in tries.items():
            log = f"train-{case.key}-{allocator}-{batch}"
            fresh = run.child("train", {"case": case.as_dict(), "size": batch}, log, conf)
            details[f"fresh_{batch}"] = fresh
            if not fresh.get("ok"):
                verdicts.append((False, f"{batch} error: {fresh.get('error')}"))
                continue
            peak = fresh.get("max_reserved_bytes", fresh.get("peak_bytes"))
            # A card of the limit's size holds what the allocator reserves; under cudaMallocAsync
            # the fraction caps only requested bytes, so a pool above the limit did not fit.
            over = run.plan.cuda and fresh["fits"] and peak is not None and peak > case.limit_bytes
            fits = fresh["fits"] and not over
            word = "trains" if fits else ("trains, reserving more than the cap" if over else "OOM")
            shown = f"{batch} {word}" + (f" ({size(peak)})" if fresh["fits"] else "")
            verdicts.append((fits == expected, shown))
        if not found["boundary_reached"]:
            verdicts.append((True, f"(search stopped: {found['stop_reason']}, max + 1 not tried)"))
        safe = f"safe {found['safe_batch']}{'' if found['safe_verified'] else ' UNVERIFIED'}"
        summary = f"{case.limit_text}: find max {top}, {safe}; fresh: " + ", ".join(text for _, text in verdicts)
        return Record(name, all(ok for ok, _ in verdicts) and found["safe_verified"], summary, details)

    check.__name__ = name
    return check


def main_find(run: Run) -> tuple[dict[str, Any] | None, str | None]:
    """The main case's ``find()`` result (native allocator), from the cap check or run now."""
    key = f"{run.plan.main.key}-native"
    if key not in run.finds:
        answer = run_find(run, run.plan.main, "native", None)
        if not answer.get("ok"):
            return None, f"find() failed: {answer.get('error')}"
    return json.loads(run.finds[key].read_text()), None


def estimate_vs_find(run: Run) -> Record:
    """``estimate()`` beside ``find()``: same model, same limit, nothing kept aside."""
    case = run.plan.main
    found, error = main_find(run)
    if found is None:
        return Record("estimate vs find", False, str(error))
    path = fresh(run.out / f"estimate-{case.key}.json")
    answer = run.child("estimate", {"case": case.as_dict(), "out": str(path)}, f"estimate-{case.key}")
    details = {"case": case.as_dict(), "estimate": answer, "find": {k: found[k] for k in ("max_batch", "safe_batch")}}
    if not answer.get("ok"):
        return Record("estimate vs find", False, f"estimate() failed: {answer.get('error')}", details)
    ratio = answer["max_batch"] / found["max_batch"]
    details["ratio"], details["band"] = ratio, ESTIMATE_BAND
    summary = (
        f"{case.limit_text}: estimate {answer['max_batch']}/{answer['safe_batch']} ({answer['elapsed_s']:.0f} s), "
        f"find {found['max_batch']}/{found['safe_batch']} ({found['elapsed_s']:.0f} s) (max/safe): x{ratio:.2f}"
    )
    return Record("estimate vs find", ESTIMATE_BAND[0] <= ratio <= ESTIMATE_BAND[1], summary, details)


def throughput(run: Run) -> Record:
    """``find()``'s samples/s and knee beside plain steady-state steps at the same sizes."""
    case = run.plan.main
    found, error = main_find(run)
    if found is None:
        return Record("throughput", False, str(error))
    timed: dict[int, dict[str, Any]] = {}
    for trial in found["trials"]:  # each size's trial with the most timed steps, as the library does
        if trial["fits"] and trial["samples_per_s"]:
            known = timed.get(trial["batch_size"])
            if known is None or len(trial["step_times_s"]) > len(known["step_times_s"]):
                timed[trial["batch_size"]] = trial
    knee = (found.get("throughput") or {}).get("knee_batch")
    best = found["best_throughput_batch"]
    sizes = sorted({min(timed) if timed else 1, knee or best, best, found["max_batch"]})
    args = {"case": case.as_dict(), "sizes": sizes, "warmup": run.plan.warmup, "timed": run.plan.timed}
    plain = run.child("throughput", args, f"throughput-{case.key}")
    details: dict[str, Any] = {"knee": knee, "best": best, "sizes": sizes, "plain": plain}
    details["find_throughput"] = found.get("throughput")
    if not plain.get("ok"):
        return Record("throughput", False, f"plain loop failed: {plain.get('error')}", details)
    rows = {}
    for n in sizes:
        rate = plain["rates"][str(n)]["samples_per_s"]
        mine = timed[n]["samples_per_s"] if n in timed else None
        rows[n] = {"plain": rate, "find": mine, "ratio": mine / rate if mine and rate else None}
    rates = ", ".join(f"{n}: {r['plain']:.0f}" if r["plain"] else f"{n}: OOM" for n, r in rows.items())
    ratios = "/".join(f"{r['ratio']:.2f}" if r["ratio"] else "-" for r in rows.values())
    details["rows"] = rows
    measured = [r["plain"] for r in rows.values() if r["plain"]]
    knee_share = rows[knee or best]["plain"] / max(measured) if measured and rows[knee or best]["plain"] else 0.0
    best_ratio = rows[best]["ratio"]
    judged_ok = knee_share >= KNEE_SHARE and best_ratio is not None and RATE_BAND[0] <= best_ratio <= RATE_BAND[1]
    details.update(knee_share=knee_share, judged=run.plan.cuda, judged_ok=judged_ok)
    summary = f"knee {knee}, best {best}; plain samples/s {rates}; find/plain {ratios}; knee {knee_share:.0%}"
    if not run.plan.cuda:  # two shared CPU cores time noise: the numbers are shown, not judged
        summary += " (not judged on CPU)"
        return Record("throughput", len(measured) == len(sizes), summary, details)
    return Record("throughput", judged_ok, summary, details)


def gate(run: Run) -> Record:
    """``batchfit probe --require-batch`` with and without ``--reserve auto``, against the probe's max."""
    spec = run.plan.gate
    base = [sys.executable, "-m", "batchfit", "probe", spec["target"], "--memory-limit", spec["limit"]]
    base += ["--device", "cuda" if run.plan.cuda else "cpu", "--quiet"]
    runs: dict[str, dict[str, Any]] = {}

    def cli(label: str, extra: list[str]) -> dict[str, Any]:
        path = fresh(run.out / f"gate-{label}.json")
        rc, output = run.command(base + extra + ["--json", str(path)], f"gate-{label}", run.plan.timeouts["cli"])
        document = json.loads(path.read_text()) if path.exists() else None
        if document is not None:
            run.documents.append((f"gate {label}", path))
        runs[label] = {"exit_code": rc, "argv": extra, "tail": output[-600:], "document": document}
        return runs[label]

    probe = cli("probe", [])
    details = {"spec": spec, "runs": runs}
    if probe["exit_code"] != 0 or not probe["document"]:
        return Record("gate", False, f"the probe failed: exit {probe['exit_code']}", details)
    top, boundary = probe["document"]["max_batch"], probe["document"]["boundary_reached"]
    n = spec["require"]
    plain = cli(f"require-{n}", ["--require-batch", str(n)])["exit_code"]
    reserved = cli(f"require-{n}-reserve-auto", ["--require-batch", str(n), "--reserve", "auto"])
    above = cli(f"require-{top + 1}", ["--require-batch", str(top + 1)])["exit_code"] if boundary else None
    budget = (reserved["document"] or {}).get("budget_bytes")
    checks = {
        "verdicts, not errors": plain in (0, 3) and reserved["exit_code"] in (0, 3) and above in (0, 3, None),
        f"require {n} agrees with max {top}": plain == (0 if n <= top else 3),
        "a reserve never passes what the full limit fails": not (plain == 3 and reserved["exit_code"] == 0),
        f"require {top + 1} fails": above in (3, None),
    }
    details["checks"] = checks
    summary = (
        f"{spec['limit']}: probe max {top}; exit codes: require {n} {plain}, with --reserve auto "
        f"{reserved['exit_code']} (budget {size(budget)}), require {top + 1} {above}"
    )
    failed = [k for k, ok in checks.items() if not ok]
    return Record("gate", not failed, summary + (f"; wrong: {'; '.join(failed)}" if failed else ""), details)


def leaks(run: Run) -> Record:
    """Every trial of every result written in this run leaked nothing."""
    trials: list[tuple[str, dict[str, Any]]] = []
    for source, path in run.documents:
        document = json.loads(path.read_text())
        found = list(document.get("trials", []))
        found += [document["trial"]] if document.get("trial") else []
        found += (document.get("search") or {}).get("trials", [])
        trials += [(source, t) for t in found]
    leaked = [
        {"source": s, "batch_size": t["batch_size"], "kind": t["kind"], "leaked_bytes": t["leaked_bytes"]}
        for s, t in trials
        if t.get("leaked_bytes")
    ]
    details = {"documents": [s for s, _ in run.documents], "trials": len(trials), "leaked": leaked}
    if not trials:
        return Record("leaks", None, "no result documents were written to read trials from", details)
    worst = max((x["leaked_bytes"] for x in leaked), default=0)
    summary = f"{len(trials)} trials in {len(run.documents)} results: {len(leaked)} leaked" + (
        f" (worst {size(worst)})" if leaked else ""
    )
    return Record("leaks", not leaked, summary, details)


def frontier(run: Run) -> Record:
    """``batchfit.frontier`` on the main case's model at the plan's lengths, in a fresh process:
    every point's boundary found and its safe batch verified, and the longest length at batch 1
    found. Its JSON and picture are kept (``frontier-<case>.json`` / ``.png``) to be committed.
    The gradient noise scale is not measured by batchfit yet."""
    case = run.plan.main
    out, plot = fresh(run.out / f"frontier-{case.key}.json"), fresh(run.out / f"frontier-{case.key}.png")
    args = {"case": case.as_dict(), "seq_lens": run.plan.seq_lens, "out": str(out), "plot": str(plot)}
    answer = run.child("frontier", args, f"frontier-{case.key}")
    details = {"case": case.as_dict(), "frontier": answer}
    if not answer.get("ok"):
        return Record("frontier", False, f"frontier() failed: {answer.get('error')}", details)
    points = answer["points"]
    exact = all(p["boundary_reached"] and p["safe_verified"] for p in points)
    passed = exact and answer["longest_at_batch_1"] is not None
    shown = ", ".join(f"{p['seq_len']}: {p['max_batch']}/{p['safe_batch']}" for p in points)
    summary = (
        f"{case.limit_text}: seq_len: max/safe {shown}; longest at batch 1 {answer['longest_at_batch_1']} "
        f"({answer['longest_limited_by']}); {answer['trials']} trials in {answer['elapsed_s']:.0f} s"
        + ("" if exact else "; NOT EXACT at every length")
        + ("" if answer["plotted"] else "; no picture (matplotlib missing)")
    )
    return Record("frontier", passed, summary, details)
