"""The checks of ``benchmarks/gpu.py``: each runs fresh processes and returns one :class:`Record`.

The parent process never imports torch, so it holds no CUDA context and no GPU memory that a
child's cap or ``--reserve auto`` would have to share. The checks run at once, each in a thread of
the parent, and their children share the GPU through :class:`Lanes`: a child starts when its cap
and a CUDA context fit beside those running in the memory that was free at the preflight. A
section that times steps or reads the whole device's free memory runs alone (:meth:`Lanes.alone`).
Every child has a timeout, clipped to the run's hard end (``--deadline``); a check that its child
left unanswered because the hard end came says so and counts as not run, not as failed.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proof_children import FRESH_STEPS, MARK

ROOT = Path(__file__).resolve().parent.parent
GPU_PY = Path(__file__).resolve().parent / "gpu.py"
GiB = 2**30
#: Seconds a child has, after SIGINT, to write what it has (pytest: its JUnit XML) before SIGKILL.
INTERRUPT_GRACE_S = 15.0
#: What a CUDA child holds outside its cap (its context, lazily loaded kernels), counted in its lane:
#: 0.5-1 GiB on an H100/H200 with CUDA 12-13, so 2 GiB leaves room.
CONTEXT_BYTES = 2 * GiB
#: What the lanes leave of the memory free at the preflight, for what nobody counted.
POOL_MARGIN_BYTES = 4 * GiB
#: The compile tests' lane on CUDA: their caps are 1-2 GiB, plus a context and Triton's.
COMPILE_TESTS_BYTES = 6 * GiB
#: ``estimate max / find max`` inside this band passes (above 1, the estimate promises sizes
#: that did not train); one batch either side of ``find()``'s max always passes
#: (:func:`estimate_within_band`).
ESTIMATE_BAND = (0.85, 1.05)
#: Why a CUDA test may skip on a healthy GPU box (a regex on the skip's message), and why that is
#: fine. Any other skip of a test marked ``cuda`` fails the check.
ALLOWED_SKIPS = {
    r"needs two visible CUDA devices": "one GPU here: the cuda:1 test needs two",
}
#: CUDA tests the proof leaves out of its pytest run (``--deselect``, by node id prefix), and why.
DESELECTED = {
    "tests/test_cuda_allocator.py::test_the_largest_batch_trains_in_a_fresh_process_under_the_same_cap_and_one_"
    "more_does_not": "the 3 allocator tests, which repeat the cap checks",
}
#: The user property batchfit's pytest plugin gives every ``cuda`` test (``CUDA_PROPERTY`` there).
CUDA_PROPERTY = ("batchfit-marker", "cuda")
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
    """What runs here: the main case (estimate, throughput), the caps checked, the gate, timings,
    and what the children share (``capacity``: bytes of GPU memory on CUDA, cores on CPU)."""

    cuda: bool
    main: Case
    caps: list[tuple[str, Case, str, str | None]]  # (check name, case, allocator, PYTORCH_CUDA_ALLOC_CONF)
    gate: Case  # probed by the CLI as ``gate_target``; its max and max + 1 also trained from scratch
    gate_target: str
    warmup: int
    timed: int
    timeouts: dict[str, float]
    seq_lens: list[int] = field(default_factory=list)  # the frontier's lengths
    capacity: int = 1

    def cost(self, limit_bytes: int | None = None, allocator: str = "native") -> int:
        """A child's lane: on CUDA its cap and a context (``cudaMallocAsync``'s pool may reserve a
        little over the cap: a sixteenth more); on CPU one core."""
        if not self.cuda:
            return 1
        limit = limit_bytes or 0
        return limit + CONTEXT_BYTES + (limit // 16 if allocator == "cudaMallocAsync" else 0)

    @property
    def compile_cost(self) -> int:
        return COMPILE_TESTS_BYTES if self.cuda else 1


def pool_bytes(free_bytes: int) -> int:
    """The lanes' capacity on CUDA: the memory free at the preflight less :data:`POOL_MARGIN_BYTES`."""
    return max(0, free_bytes - POOL_MARGIN_BYTES)


def at_once(capacity: int, cost: int, beside: int = 0) -> int:
    """How many children of ``cost`` run at once in ``capacity`` beside ``beside`` (at least one:
    a child larger than the rest runs when nothing else does)."""
    return max(1, (capacity - beside) // cost) if cost > 0 else 1


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

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output  # what the child printed before it was stopped


class Lanes:
    """The GPU memory free at the preflight (on CPU: the cores) shared out among the children.

    A child asks for its cost (:meth:`Plan.cost`) and starts once its cost and those of the
    children running fit the capacity: a lane is no fixed slot, only the rule that what runs at
    once fits what was free. The earliest request that fits starts first (a smaller later one may
    pass a larger one that does not fit yet), and a request larger than the whole capacity starts
    when nothing else runs.

    A section that must run alone (timed steps; ``--reserve auto`` and the CUDA tests, which read
    the whole device's free memory) waits until every other check has finished or waits to run
    alone too; such sections then run one at a time, in the order given. ``workers`` counts the
    checks at work (set before their threads start; each says :meth:`done` at its end).
    """

    def __init__(self, capacity: int, workers: int = 0) -> None:
        self.capacity = capacity
        self.workers = workers
        self.held: dict[int, int] = {}  # ticket -> cost, of the children running
        self.queue: dict[int, int] = {}  # ticket -> cost, of the children waiting (in arrival order)
        self.first: set[int] = set()  # tickets that go before the others (the longest process)
        self.alone_queue: list[tuple[int, int]] = []  # (order, ticket) of the sections waiting to run alone
        self.alone_owner: int | None = None  # the thread running alone now
        self.peak = (0, 0)  # (children at once, their costs) at the busiest
        self._tickets = itertools.count()
        self._cond = threading.Condition()

    def next_admitted(self) -> int | None:
        """The waiting request that starts now, if any: the earliest that fits beside those running."""
        if self.alone_owner is not None:
            return None
        used, order = sum(self.held.values()), sorted(self.queue, key=lambda t: (t not in self.first, t))
        return next((t for t in order if not self.held or used + self.queue[t] <= self.capacity), None)

    @contextlib.contextmanager
    def lane(self, cost: int, until: float, first: bool = False) -> Iterator[None]:
        """Hold ``cost`` while the block runs; :class:`Cut` if no lane came free by ``until``
        (monotonic). ``first``: before the requests that are not (the longest process)."""
        if self.alone_owner == threading.get_ident():  # a section running alone has the whole device
            yield
            return
        with self._cond:
            ticket = next(self._tickets)
            self.queue[ticket] = cost
            if first:
                self.first.add(ticket)
            admitted = self._cond.wait_for(
                lambda: self.next_admitted() == ticket, timeout=max(0.0, until - time.monotonic())
            )
            del self.queue[ticket]
            self.first.discard(ticket)
            if not admitted:
                self._cond.notify_all()
                raise Cut("no lane came free before the hard end")
            self.held[ticket] = cost
            if len(self.held) > self.peak[0]:
                self.peak = (len(self.held), sum(self.held.values()))
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                del self.held[ticket]
                self._cond.notify_all()

    @contextlib.contextmanager
    def alone(self, order: int, until: float) -> Iterator[None]:
        """Run the block with nothing else running, after every other check's shared work."""
        with self._cond:
            entry = (order, next(self._tickets))
            self.alone_queue.append(entry)
            self.alone_queue.sort()
            self.workers -= 1
            self._cond.notify_all()
            ready = self._cond.wait_for(
                lambda: (
                    self.alone_owner is None and not self.held and self.workers == 0 and self.alone_queue[0] == entry
                ),
                timeout=max(0.0, until - time.monotonic()),
            )
            self.alone_queue.remove(entry)
            self.workers += 1
            if not ready:
                self._cond.notify_all()
                raise Cut("its turn to run alone did not come before the hard end")
            self.alone_owner = threading.get_ident()
        try:
            yield
        finally:
            with self._cond:
                self.alone_owner = None
                self._cond.notify_all()

    def done(self) -> None:
        """A check's thread has finished."""
        with self._cond:
            self.workers -= 1
            self._cond.notify_all()


class Run:
    """What the checks share: the plan, the output folder, the clock, the lanes and the documents written."""

    def __init__(self, plan: Plan, out: Path, deadline_s: float, started: float) -> None:
        self.plan, self.out, self.started = plan, out, started
        self.deadline_s, self.hard_end = deadline_s, started + deadline_s
        self.lanes = Lanes(plan.capacity)
        self.finds: dict[str, dict[str, Any]] = {}  # find() answers by "<case>-<allocator>", their JSON in "path"
        self.documents: list[tuple[str, Path]] = []  # every result document, for the leak check
        self.timeline: list[dict[str, Any]] = []  # every process started: when, how long, its lane
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._find_locks: dict[str, threading.Lock] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, text: str) -> None:
        with self._lock:
            print(f"[{self.elapsed():5.0f} s] {text}", flush=True)

    def find_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._find_locks.setdefault(key, threading.Lock())

    def command(
        self,
        argv: list[str],
        log: str,
        timeout: float,
        alloc_conf: str | None = None,
        cost: int | None = None,
        first: bool = False,
    ) -> tuple[int, str]:
        """Run ``argv`` in a lane of ``cost`` (default: a child without a cap; ``first``: before the
        other requests) with a timeout; ``(exit code, output)``; the output also goes to ``logs/``.

        At the timeout the process group gets SIGINT first (pytest then writes its JUnit XML and
        summary, a Python child its traceback) and SIGKILL only :data:`INTERRUPT_GRACE_S` later.
        """
        cost = self.plan.cost() if cost is None else cost
        queued = self.elapsed()
        with self.lanes.lane(cost, self.hard_end - INTERRUPT_GRACE_S - 5, first):
            left = self.hard_end - time.monotonic() - INTERRUPT_GRACE_S  # SIGINT early enough to end by then
            if left < 5:
                raise Cut(f"{log}: no time left before the hard end")
            limit = min(timeout, left)
            began = self.elapsed()
            entry = {"log": log, "cost": cost, "queued_s": round(queued, 1), "start_s": round(began, 1)}
            if cost >= self.plan.capacity or self.lanes.alone_owner == threading.get_ident():
                lane = "alone"
            else:
                lane = size(cost) if self.plan.cuda else f"{cost} core"
            self.say(f"  + {log} ({lane}{f', waited {began - queued:.0f} s' if began - queued >= 1 else ''})")
            env = child_env(not self.plan.cuda, alloc_conf)
            # A session of its own, so that a timeout stops its children too (pytest starts some).
            with subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            ) as process:
                timed_out = False
                try:
                    output, _ = process.communicate(timeout=limit)
                except subprocess.TimeoutExpired:
                    output, timed_out = _interrupt(process), True
            rc = 124 if timed_out else process.returncode
            entry.update(end_s=round(self.elapsed(), 1), exit_code=rc)
            with self._lock:
                self.timeline.append(entry)
            if timed_out:
                (self.logs / f"{log}.log").write_text(" ".join(argv) + "\n" + output + "\n[timed out]\n")
                if timeout > left:
                    raise Cut(f"{log}: stopped at the hard end (--deadline {self.deadline_s:.0f} s)", output)
                return 124, output + f"\n[timed out after {timeout:.0f} s]"
        (self.logs / f"{log}.log").write_text(" ".join(argv) + "\n" + output)
        return rc, output

    def child(
        self, name: str, args: dict[str, Any], log: str, alloc_conf: str | None = None, cost: int | None = None
    ) -> dict[str, Any]:
        """A fresh process running ``proof_children.CHILDREN[name]``; its answer, or ``ok: False``."""
        args = {"device": "cuda" if self.plan.cuda else "cpu", **args}
        timeout = self.plan.timeouts.get(name, 300)
        rc, output = self.command(child_argv(name, args), log, timeout, alloc_conf, cost)
        answer = answer_of(output) or {"ok": False, "error": f"exit {rc}, no answer: {output.strip()[-300:]}"}
        answer["exit_code"] = rc
        return answer

    def alone(self, order: int) -> contextlib.AbstractContextManager[None]:
        """A section of a check that runs with nothing else running (see :meth:`Lanes.alone`)."""
        return self.lanes.alone(order, self.hard_end - INTERRUPT_GRACE_S - 5)


def parallel(jobs: dict[Any, Callable[[], Any]]) -> dict[Any, Any]:
    """Each job in a thread of its own (their children then wait for lanes); their results by
    key, or the first exception (a :class:`Cut` included) once all have ended."""
    if len(jobs) <= 1:
        return {key: job() for key, job in jobs.items()}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        concurrent.futures.wait(futures.values())
    return {key: future.result() for key, future in futures.items()}


def child_env(cpu_only: bool, alloc_conf: str | None = None) -> dict[str, str]:
    """The environment of every process the proof starts: this source tree importable (batchfit is
    not installed on a GPU box), the allocator configuration given and no other, and on the CPU run
    (``--device cpu`` on a GPU box too) no GPU visible."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # One thread: on shared cores torch's OpenMP threads wait on each other and one busy
        # neighbour makes steps many times slower, in find() and the plain loop unequally.
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def child_argv(name: str, args: dict[str, Any]) -> list[str]:
    """The command line of ``proof_children.CHILDREN[name](args)`` in a fresh interpreter."""
    return [sys.executable, str(GPU_PY), "--child", name, "--args", json.dumps(args)]


def answer_of(output: str) -> dict[str, Any] | None:
    """A child's answer: its last line marked :data:`~proof_children.MARK` (``None``: it printed none)."""
    marked = [line for line in output.splitlines() if line.startswith(MARK)]
    return json.loads(marked[-1][len(MARK) :]) if marked else None


def _interrupt(process: subprocess.Popen[str]) -> str:
    """SIGINT to ``process``'s group, SIGKILL if it is still there after the grace; its output."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        output, _ = process.communicate(timeout=INTERRUPT_GRACE_S)
        return output
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return output + "\n[killed: no exit within the grace after SIGINT]"


# The CUDA tests -----------------------------------------------------------------------------------
@dataclass
class JUnitCases:
    """A JUnit XML report read as the proof judges it: CUDA tests apart from the rest."""

    ran: list[str] = field(default_factory=list)  # CUDA tests that ran (passed or not)
    failed: list[str] = field(default_factory=list)  # any test case with a failure or an error
    allowed_skips: dict[str, str] = field(default_factory=dict)  # CUDA test -> why its skip is fine
    skipped: dict[str, str] = field(default_factory=dict)  # CUDA test -> its skip's message (not allowed)
    other_skips: dict[str, str] = field(default_factory=dict)  # not a CUDA test (a module skipped at collection)


def read_junit(path: Path) -> JUnitCases:
    """Sort a JUnit report's cases: only a test marked ``cuda`` (its :data:`CUDA_PROPERTY`) can
    count as skipped, and only a skip outside :data:`ALLOWED_SKIPS` fails the check; a module that
    skipped itself at collection (ray not installed, say) is no CUDA test and is only listed."""
    cases = JUnitCases()
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        props = {(p.get("name"), p.get("value")) for p in case.iter("property")}
        if case.find("failure") is not None or case.find("error") is not None:
            cases.failed.append(name)
        skip = case.find("skipped")
        if skip is None:
            if CUDA_PROPERTY in props:
                cases.ran.append(name)
            continue
        # A module skipped at collection says why in the element's text, not its message.
        message = " ".join(filter(None, (skip.get("message"), (skip.text or "").strip())))[:300]
        if CUDA_PROPERTY not in props:
            cases.other_skips[name] = message
            continue
        why = next((why for pattern, why in ALLOWED_SKIPS.items() if re.search(pattern, message)), None)
        if why is not None:
            cases.allowed_skips[name] = why
        else:
            cases.skipped[name] = message
    return cases


def merge_junit(paths: list[Path], target: Path) -> None:
    """The test suites of several JUnit reports in one ``<testsuites>`` (a GPU box sends back 8 files)."""
    root = ElementTree.Element("testsuites")
    for path in paths:
        top = ElementTree.parse(path).getroot()
        root.extend([top] if top.tag == "testsuite" else list(top.iter("testsuite")))
    ElementTree.ElementTree(root).write(target, encoding="utf-8", xml_declaration=True)


#: pytest's closing count (``-q``: ``31 passed, 3 skipped, 1617 deselected in 147.01s``).
PYTEST_COUNTS = re.compile(r"^=*\s*\d+ (passed|failed|skipped|deselected|errors?)\b.* in [\d.]+s\b", re.M)


def pytest_finished(output: str) -> bool:
    """Whether pytest ran to its own end: its closing count printed, and not after an interrupt
    (a SIGINT prints the count of what ran so far too). The third H200 run's 31 tests passed in
    147 s of a 150 s slice, and the slice's end read them as cut short."""
    return PYTEST_COUNTS.search(output) is not None and "KeyboardInterrupt" not in output


def marks_cuda(source: str) -> bool:
    """Whether a test module's source marks a test ``cuda``: ``@pytest.mark.cuda`` on a test or a
    class, or a ``pytestmark`` that holds it (read as code: a test that writes such a file in a
    string does not count)."""
    if "pytest.mark.cuda" not in source:
        return False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if any(ast.unparse(d).startswith("pytest.mark.cuda") for d in node.decorator_list):
                return True
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            if "pytest.mark.cuda" in ast.unparse(node.value):
                return True
    return False


def cuda_test_files(root: Path = ROOT) -> list[str]:
    """The test files that hold tests marked ``cuda``, as paths from ``root``: pytest collects these
    alone, not the whole suite's ~1,900 tests (22-25 s a run on the H200 only to deselect them)."""
    tests = sorted((root / "tests").glob("test_*.py"))
    return [str(path.relative_to(root)) for path in tests if marks_cuda(path.read_text())]


def pytest_check(name: str, marks: str, timeout_key: str, alone: int | None, deselect: dict[str, str]) -> Any:
    """``pytest FILES -m MARKS --require-cuda`` on :func:`cuda_test_files` with JUnit XML, less the
    tests of ``deselect`` (node id prefixes), in a lane (``alone=None``) or alone (its order); on
    CPU the same collection, all skipped.

    Stopped by SIGINT at its time (``plan.timeouts[timeout_key]``, clipped to the run's hard end),
    so that the tests which ran are still reported: the check then says how far it got.
    """
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")

    def check(run: Run) -> Record:
        xml = fresh(run.out / f"{slug}.xml")
        files = cuda_test_files()
        argv = [sys.executable, "-m", "pytest", *files, "-m", marks, "-q", "-p", "no:cacheprovider"]
        argv += [f"--junitxml={xml}", *(["--require-cuda"] if run.plan.cuda else [])]
        argv += [arg for node in deselect for arg in ("--deselect", node)]
        cost = run.plan.compile_cost if alone is None else run.plan.capacity
        try:
            with run.alone(alone) if alone is not None else contextlib.nullcontext():
                # In a lane, the longest process of all: it goes first.
                rc, output = run.command(argv, slug, run.plan.timeouts[timeout_key], cost=cost, first=alone is None)
        except Cut as exc:  # at the hard end: what ran is still worth reading
            rc, output = 124, exc.output or str(exc)
        stopped = rc == 124 and not pytest_finished(output)
        details: dict[str, Any] = {"exit_code": rc, "marks": marks, "files": files, "deselected": deselect}
        details.update(junit_xml=xml.name, alone=alone is not None, tail=output[-1500:])
        if not xml.exists():
            return Record(name, None if stopped else False, f"no JUnit XML (exit {rc}): {output[-120:]}", details)
        cases = read_junit(xml)
        details.update(cases.__dict__)
        left_out = f"; deselected: {'; '.join(deselect.values())}" if deselect else ""
        if not run.plan.cuda:
            ok = (rc == 0 or stopped) and not cases.failed and not cases.ran
            summary = f"no CUDA: {len(cases.skipped) + len(cases.allowed_skips)} collected in {len(files)} files, "
            summary += "all skipped (JUnit XML)" + ("; stopped" if stopped else "")
            return Record(name, None if ok else False, summary + left_out, details)
        allowed = f", {len(cases.allowed_skips)} skipped as expected" if cases.allowed_skips else ""
        summary = f"-m '{marks}' ({len(files)} files): {len(cases.ran)} ran, {len(cases.failed)} failed{allowed}"
        summary += f", {len(cases.skipped)} skipped: {'; '.join(cases.skipped.values())[:120]}" if cases.skipped else ""
        summary += f": {', '.join(f.split('::')[-1] for f in cases.failed[:4])}" if cases.failed else ""
        if stopped:
            summary += "; STOPPED by its time limit (the rest did not run)"
        bad = bool(cases.failed or cases.skipped) or (rc != 0 and not stopped) or not cases.ran
        passed = False if bad else (None if stopped else True)
        return Record(name, passed, summary + f" (exit {rc})" + left_out, details)

    check.__name__ = name
    return check


# The checks ---------------------------------------------------------------------------------------
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
    """``find()`` in a fresh process, once per case and allocator: its answer is kept for the checks
    after it (its result's JSON in ``answer["path"]``)."""
    key = f"{case.key}-{allocator}"
    with run.find_lock(key):
        if key not in run.finds:
            path = fresh(run.out / f"find-{key}.json")
            args = {"case": case.as_dict(), "out": str(path)}
            answer = run.child("find", args, f"find-{key}", conf, run.plan.cost(case.limit_bytes, allocator))
            if answer.get("ok"):
                answer["path"] = str(path)
                run.documents.append((f"find {key}", path))
            run.finds[key] = answer
        return run.finds[key]


def main_find(run: Run) -> tuple[dict[str, Any] | None, str | None]:
    """The main case's ``find()`` result (native allocator), from the cap check or run now."""
    answer = run_find(run, run.plan.main, "native", None)
    if not answer.get("ok"):
        return None, f"find() failed: {answer.get('error')}"
    return json.loads(Path(answer["path"]).read_text()), None


def fresh_text(answer: dict[str, Any]) -> str:
    """How a fresh process went, in the words of its rule (``proof_children.judge_fresh``), short."""
    if not answer.get("ok"):
        return f"error: {answer.get('error')}"
    oom = answer.get("oom")
    if not oom:
        return str(answer.get("why") or ("trains" if answer.get("fits") else "does not fit"))
    asked = re.search(r"Tried to allocate [\d.]+ \w+", oom.get("message") or "")
    text = f"OOM in the {oom.get('phase') or '?'}" + (f" of step {oom['step']}" if oom.get("step") else "")
    text += f" ({asked.group(0)})" if asked else ""
    return text + (" VOID: the whole device ran full, not the cap" if answer.get("void") else "")


def train_both_sides(run: Run, case: Case, top: int, above: bool, conf: str | None, allocator: str, log: str) -> Any:
    """Fresh ``train`` children at ``top`` (must fit) and, when ``above``, ``top + 1`` (must not),
    in parallel lanes: ``{size: (answer, as expected)}``."""
    cost = run.plan.cost(case.limit_bytes, allocator)
    expected = {top: True} | ({top + 1: False} if above else {})

    def job(batch: int) -> Callable[[], dict[str, Any]]:
        args = {"case": case.as_dict(), "size": batch, "steps": FRESH_STEPS}
        return lambda: run.child("train", args, f"{log}-{batch}", conf, cost)

    answers = parallel({batch: job(batch) for batch in expected})
    return {
        batch: (answer, bool(answer.get("ok") and not answer.get("void") and answer.get("fits") is expected[batch]))
        for batch, answer in answers.items()
    }


def cap_check(name: str, case: Case, allocator: str, conf: str | None) -> Any:
    """The cap's honesty from scratch on both sides: ``find()``'s max trains :data:`FRESH_STEPS`
    steps in a fresh process under the same cap, and max + 1 does not, each by the rule of its
    allocator (``proof_children.judge_fresh``)."""

    def check(run: Run) -> Record:
        found = run_find(run, case, allocator, conf)
        details: dict[str, Any] = {"case": case.as_dict(), "alloc_conf": conf, "find": found}
        if not found.get("ok"):
            return Record(name, False, f"find() failed: {found.get('error')}", details)
        top = found["max_batch"]
        wanted = {"native": "native", "cudaMallocAsync": "cudaMallocAsync"}.get(allocator)
        if run.plan.cuda and wanted and found.get("allocator") != wanted:
            return Record(name, False, f"the child ran allocator {found.get('allocator')}, not {wanted}", details)
        log = f"train-{case.key}-{allocator}"
        sides = train_both_sides(run, case, top, found["boundary_reached"], conf, allocator, log)
        details.update({f"fresh_{batch}": answer for batch, (answer, _) in sides.items()})
        verdicts = [(ok, f"{batch} {fresh_text(answer)}") for batch, (answer, ok) in sides.items()]
        if not found["boundary_reached"]:
            verdicts.append((True, f"(search stopped: {found['stop_reason']}, max + 1 not tried)"))
        rule = next((a.get("allocator") for a, _ in sides.values() if a.get("allocator")), "?")
        safe = f"safe {found['safe_batch']}{'' if found['safe_verified'] else ' UNVERIFIED'}"
        summary = f"{case.limit_text}: find max {top}, {safe}; fresh ({FRESH_STEPS} steps, {rule} rule): "
        summary += ", ".join(text for _, text in verdicts)
        if allocator == "expandable_segments" and run.plan.cuda:
            # torch checks the fraction against mapped memory plus the whole request, then maps
            # only the missing pages: the emulated card is stricter than a real one of this size.
            summary += " (expandable segments: a cap stricter than a real card of this size; conservative)"
        return Record(name, all(ok for ok, _ in verdicts) and found["safe_verified"], summary, details)

    check.__name__ = name
    return check


def estimate_vs_find(run: Run) -> Record:
    """``estimate()`` beside ``find()``: same model, same limit, nothing kept aside."""
    case = run.plan.main
    found, error = main_find(run)
    if found is None:
        return Record("estimate vs find", False, str(error))
    path = fresh(run.out / f"estimate-{case.key}.json")
    args = {"case": case.as_dict(), "out": str(path)}
    answer = run.child("estimate", args, f"estimate-{case.key}", cost=run.plan.cost(case.limit_bytes))
    details = {"case": case.as_dict(), "estimate": answer, "find": {k: found[k] for k in ("max_batch", "safe_batch")}}
    if not answer.get("ok"):
        return Record("estimate vs find", False, f"estimate() failed: {answer.get('error')}", details)
    ratio = answer["max_batch"] / found["max_batch"]
    details["ratio"], details["band"] = ratio, ESTIMATE_BAND
    details["allowed"] = estimate_range(found["max_batch"])
    summary = (
        f"{case.limit_text}: estimate {answer['max_batch']}/{answer['safe_batch']} ({answer['elapsed_s']:.0f} s), "
        f"find {found['max_batch']}/{found['safe_batch']} ({found['elapsed_s']:.0f} s) (max/safe): x{ratio:.2f}"
    )
    return Record("estimate vs find", estimate_within_band(answer["max_batch"], found["max_batch"]), summary, details)


def estimate_range(found: int) -> tuple[int, int]:
    """The estimates of max that pass beside ``find()``'s ``found``: :data:`ESTIMATE_BAND` of it,
    widened to one batch either side (at a max of 18 the band alone would fail an estimate of 19)."""
    low = min(found - 1, math.ceil(ESTIMATE_BAND[0] * found))
    high = max(found + 1, math.floor(ESTIMATE_BAND[1] * found))
    return max(1, low), high


def estimate_within_band(estimated: int, found: int) -> bool:
    low, high = estimate_range(found)
    return low <= estimated <= high


def throughput(run: Run) -> Record:
    """``find()``'s samples/s and knee beside plain steady-state steps at the same sizes (both run
    alone: ``gpu.py`` runs this check, and the ``find()`` it reads, before the others start)."""
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
    plain = run.child("throughput", args, f"throughput-{case.key}", cost=run.plan.capacity)
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


#: The order of the sections that run alone once the shared work is done: the short one first.
ALONE_ORDER = {"gate": 1, "cuda tests": 2}


def gate(run: Run) -> Record:
    """``batchfit probe --require-batch`` against the probe's max, with and without ``--reserve
    auto``, at max + 1, and both sides from scratch: max trains in a fresh process and max + 1
    does not, by the native rule.

    The model (``plan.gate``) holds far more per sample than the allocator's 2 MiB segment
    rounding, so max + 1 cannot pass in the slack of max's segments; the required batch is 3/4 of
    the max, as a CI gate keeps a margin. The gate at max + 1 runs with ``--init-batch max + 1``:
    no search below it (the probe already made it). ``--reserve auto`` measures what lives outside
    the allocator on the whole device, so that run waits to run alone.
    """
    case = run.plan.gate
    cost = run.plan.cost(case.limit_bytes)
    base = [sys.executable, "-m", "batchfit", "probe", run.plan.gate_target, "--memory-limit", str(case.limit_bytes)]
    base += ["--device", "cuda" if run.plan.cuda else "cpu", "--quiet"]
    runs: dict[str, dict[str, Any]] = {}

    def cli(label: str, extra: list[str]) -> dict[str, Any]:
        path = fresh(run.out / f"gate-{label}.json")
        argv = base + extra + ["--json", str(path)]
        rc, output = run.command(argv, f"gate-{label}", run.plan.timeouts["cli"], cost=cost)
        document = json.loads(path.read_text()) if path.exists() else None
        if document is not None:
            run.documents.append((f"gate {label}", path))
        runs[label] = {"exit_code": rc, "argv": extra, "tail": output[-600:], "document": document}
        return runs[label]

    probe = cli("probe", [])
    details: dict[str, Any] = {"case": case.as_dict(), "target": run.plan.gate_target, "runs": runs}
    if probe["exit_code"] != 0 or not probe["document"]:
        return Record("gate", False, f"the probe failed: exit {probe['exit_code']}", details)
    top, boundary = probe["document"]["max_batch"], probe["document"]["boundary_reached"]
    n = max(1, top * 3 // 4)
    jobs: dict[str, Callable[[], Any]] = {
        "plain": lambda: cli(f"require-{n}", ["--require-batch", str(n)]),
        "sides": lambda: train_both_sides(run, case, top, boundary, None, "native", "train-gate"),
    }
    if boundary:
        above_args = ["--require-batch", str(top + 1), "--init-batch", str(top + 1)]
        jobs["above"] = lambda: cli(f"require-{top + 1}", above_args)
    done = parallel(jobs)
    with run.alone(ALONE_ORDER["gate"]):
        reserved = cli(f"require-{n}-reserve-auto", ["--require-batch", str(n), "--reserve", "auto"])
    plain, above = done["plain"]["exit_code"], done["above"]["exit_code"] if boundary else None
    sides = done["sides"]
    details["fresh"] = {batch: answer for batch, (answer, _) in sides.items()}
    budget = (reserved["document"] or {}).get("budget_bytes")
    checks = {
        "verdicts, not errors": plain in (0, 3) and reserved["exit_code"] in (0, 3) and above in (0, 3, None),
        f"require {n} agrees with max {top}": plain == 0,
        "a reserve never passes what the full limit fails": not (plain == 3 and reserved["exit_code"] == 0),
        f"require {top + 1} fails": above in (3, None),
        f"{top} trains from scratch": sides[top][1],
        f"{top + 1} does not train from scratch": not boundary or sides[top + 1][1],
    }
    details["checks"] = checks
    fresh_said = "; ".join(f"{batch} from scratch: {fresh_text(answer)}" for batch, (answer, _) in sides.items())
    summary = (
        f"{case.limit_text}: probe max {top}; exit codes: require {n} {plain}, with --reserve auto "
        f"{reserved['exit_code']} (budget {size(budget)}), require {top + 1} {above}; {fresh_said}"
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
    answer = run.child("frontier", args, f"frontier-{case.key}", cost=run.plan.cost(case.limit_bytes))
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


#: The CUDA tests but the compile ones, alone (they read the whole device's free memory:
#: ``reserve="auto"``, a limit clipped to what is reachable), less the allocator tests.
cuda_tests = pytest_check("cuda tests", "cuda and not compile", "pytest", ALONE_ORDER["cuda tests"], DESELECTED)
#: The compile tests (torch.compile; caps of 1-2 GiB), in a lane beside the children.
compile_tests = pytest_check("compile tests", "cuda and compile", "pytest compile", None, {})


def status_of(record: Record) -> str:
    return "SKIP" if record.passed is None else ("PASS" if record.passed else "FAIL")
