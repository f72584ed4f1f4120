"""batchfit beside the finders people already use, on one GPU, each answer judged by a fresh process.

Run from the repository root (batchfit need not be installed: this tree is put on ``sys.path``)::

    python3 benchmarks/gpu_compare.py --out "$OUT/compare"          # on a GPU box, ~5 minutes (estimate)
    python3 benchmarks/gpu_compare.py --out /tmp/cmp --deadline 120  # on CPU, small models, ~2-3 minutes

Per model (on CUDA: GPT-2-small in bf16 at sequence 1024 under 24 GiB, and the built-in CNN at
224x224, width 64, 1000 classes under 5 GiB; on CPU: the built-in GPT and CNN at the small caps of
``compare.py``), one after another in this process, each on a freshly built (seeded, identical)
model under the same cap:

* **batchfit, whole answer**: ``batchfit.find()`` with its defaults (the largest batch, a verified
  safe batch, the best-throughput batch with the warm timing behind it);
* **batchfit, memory answer**: ``find(timed_steps=0)`` (the largest and the safe batch, no timing:
  what the peers answer);
* **Lightning**: ``Tuner(trainer).scale_batch_size(model, mode="binsearch")`` with its defaults
  (3 steps per trial, ``margin`` 0.05), Lightning's own fit loop (from ``lightning``, or where only
  the ``pytorch-lightning`` distribution is installed, as on the GPU box, ``pytorch_lightning``
  under that name: `lightning_alias`);
* **Accelerate**: ``find_executable_batch_size`` with its default ``starting_batch_size=128``
  around a training function (fresh AdamW, 3 steps);

then **fresh processes** judge every answer ``b``: ``python3 benchmarks/gpu.py --child train``
(a plain AdamW loop in a new interpreter, under the cap, by the rule of "fits" in
``benchmarks/proof_children.py``) at ``b`` and at ``b + 1``. The verdict is **exact** when ``b``
fits and ``b + 1`` does not, **below** when both fit, **over** when ``b`` does not. Independent
children run in parallel lanes (as many as the GPU's free memory holds at the cap, at most 4).

Last, **a profile of ``find()``'s own wall time**: one more whole-answer ``find()`` under
``cProfile``, its time split into the steps themselves (``batchfit.probe.trial._run_steps``),
the warm-ups (``CudaBackend.warm_up``), ``gc.collect``, ``torch.cuda.empty_cache``,
``torch.cuda.synchronize`` outside the steps, the trials' release and OOM recovery, and the rest;
with the batchfit functions that cost the most outside the steps.

The cap: on CUDA ``torch.cuda.set_per_process_memory_fraction(cap / total)`` (batchfit's own,
and, for the peers, set by a ``batchfit.Prober`` around their run, as ``compare.py`` does); on CPU
batchfit's live-tensor limit, under which the peers meet batchfit's out-of-memory error while
they collate and step (``compare.py``'s ``capped``/``cap_during``), and the fresh children run
batchfit's own verification trial under the same limit (the CPU has no allocator cap).

Output, under ``--out`` (default ``benchmarks/results/``), four files: ``gpu-compare-<dev>-<stamp>.json``
(everything), ``.txt`` (the table it prints), ``-profile.txt`` (``pstats`` of each profiled
``find()``) and ``-children.log`` (the fresh processes' output). ``--deadline S``: no step
(a finder, the fresh checks, the profile) starts after S seconds; what was skipped says so.
Benchmarks are not tests: nothing here asserts a timing; the goal of issue 47 item 7 (the whole
answer at most 0.5x Lightning's wall, exact where Lightning is not) is printed, not enforced.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime as _dt
import importlib.machinery
import importlib.util
import io
import json
import os
import pstats
import re
import subprocess
import sys
import time
import types
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# batchfit from this tree, first (it is not installed on a GPU box), then compare.py from this directory.
for _path in (str(HERE), str(ROOT)):
    if _path in sys.path:
        sys.path.remove(_path)
    sys.path.insert(0, _path)

import compare  # noqa: E402  (this directory, not a package)
import torch  # noqa: E402

import batchfit  # noqa: E402

GiB = 2**30
#: What a fresh child prints before its JSON answer (``proof_children.MARK``).
MARK = "BATCHFIT-PROOF "
#: Accelerate's default ``starting_batch_size``: the decorator as people use it.
ACCELERATE_START = 128
#: Steps per trial of the peers: Lightning's default ``steps_per_trial``; Accelerate's function the same.
PEER_STEPS = 3
#: Steps of a fresh child's plain loop (the proof's rule: at least 10).
FRESH_STEPS = 10
#: Seconds after which no new step starts, by device (the GPU box gives one command 10 minutes).
DEADLINES = {"cuda": 420.0, "cpu": 150.0}
#: Seconds a fresh child may take before it is stopped.
CHILD_TIMEOUT = {"cuda": 240, "cpu": 120}
#: The issue's goal: batchfit's whole answer at most this fraction of Lightning's wall time.
GOAL_RATIO = 0.5


# Models ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """A model of ``batchfit.examples`` under a cap."""

    key: str
    factory: str
    kwargs: dict[str, Any]
    amp: str | None
    cap_bytes: int

    def case(self) -> compare.Case:
        """The same thing as ``compare.py``'s case, so that its peer runners take it."""
        return compare.Case(self.factory, self.cap_bytes, dict(self.kwargs), self.amp)

    @property
    def label(self) -> str:
        return self.case().label

    def child_case(self) -> dict[str, Any]:
        """The case as ``benchmarks/proof_children.py`` reads it."""
        return {
            "key": self.key,
            "factory": self.factory,
            "kwargs": dict(self.kwargs),
            "amp": self.amp,
            "limit_bytes": self.cap_bytes,
        }


def gpu_models(total_bytes: int) -> list[Model]:
    """GPT-2-small bf16 at 24 GiB (as the proof, ``benchmarks/gpu.py``) and a CNN at 224x224
    (conv layers, cuDNN's workspaces, BatchNorm: about 59 MiB a sample, so max near 85 at 5 GiB)."""
    cap = 24 * GiB if total_bytes >= 26 * GiB else int(total_bytes * 0.8) // GiB * GiB
    return [
        Model("gpt2_small", "gpt2_small", {"seq_len": 1024}, "bf16", cap),
        Model("cnn", "cnn", {"image_size": 224, "width": 64, "classes": 1000}, None, min(5 * GiB, cap)),
    ]


#: On CPU: the built-in GPT (the GPT-2-small stand-in) and CNN at caps of ``compare.py``'s CPU
#: cases (max about 40 each, under Accelerate's start of 128).
CPU_MODELS: tuple[Model, ...] = (
    Model("gpt", "gpt", {}, None, 72_000_000),
    Model("cnn", "cnn", {}, None, 13_200_000),
)


# Rows --------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One finder's answer on one model, and how fresh processes judged it."""

    finder: str
    setting: str
    answer: int | None = None
    trials: int | None = None
    ooms: int | None = None
    wall_s: float | None = None
    sizes: list[int] = field(default_factory=list)
    fits: list[bool] = field(default_factory=list)
    note: str = ""
    skipped: str | None = None
    #: What else the finder answered (batchfit: safe and best-throughput batch, trial kinds, ...).
    extra: dict[str, Any] = field(default_factory=dict)
    fresh_at: bool | None = None
    fresh_above: bool | None = None
    verdict: str | None = None
    x_lightning_wall: float | None = None
    x_lightning_trials: float | None = None


def verdict(answer: int | None, fits_at: bool | None, fits_above: bool | None) -> str:
    """How fresh processes judged ``answer``: ``exact`` (it fits, ``answer + 1`` does not),
    ``below`` (both fit: the answer leaves batch sizes unused), ``over`` (the answer itself does
    not fit), ``unknown`` (a child gave no verdict), ``no answer``."""
    if answer is None:
        return "no answer"
    if fits_at is False:
        return "over"
    if fits_at is None or fits_above is None:
        return "unknown"
    return "below" if fits_above else "exact"


def run_find(model: Model, device: torch.device, setting: str, **options: Any) -> tuple[Row, batchfit.Result]:
    """``batchfit.find`` as a user calls it, with ``options`` (``timed_steps=0``: the memory answer)."""
    net, sample = model.case().build()
    started = time.perf_counter()
    result = batchfit.find(net, sample, memory_limit=model.cap_bytes, device=device, amp=model.amp, **options)
    wall = time.perf_counter() - started
    del net, sample
    compare.release(device)
    return find_row(result, setting, wall), result


def find_row(result: batchfit.Result, setting: str, wall: float) -> Row:
    trials = result.trials
    kinds = Counter(t.kind for t in trials)
    throughput = result.throughput
    timing_s = getattr(throughput, "timing_s", None) if throughput is not None else None
    row = Row(
        "batchfit",
        setting,
        answer=result.max_batch,
        trials=len(trials),
        ooms=sum(not t.fits for t in trials),
        wall_s=wall,
        sizes=[t.batch_size for t in trials],
        fits=[t.fits for t in trials],
    )
    row.extra = {
        "safe_batch": result.safe_batch,
        "safe_verified": result.safe_verified,
        "best_throughput_batch": result.best_throughput_batch if throughput is not None else None,
        "boundary_reached": result.boundary_reached,
        "stop_reason": result.stop_reason,
        "trial_kinds": dict(kinds),
        "timing_s": timing_s,
        "elapsed_s": result.elapsed_s,
        "notes": list(result.notes),
        "allocator": [_allocator_facts(t) for t in trials],
    }
    best = f", best-throughput {row.extra['best_throughput_batch']}" if throughput is not None else ""
    timing = f" ({timing_s:.1f} s)" if timing_s is not None else ""
    split = " + ".join(f"{n} {kind}" for kind, n in kinds.items())
    row.note = f"safe {result.safe_batch}{' verified' if result.safe_verified else ''}{best}; trials {split}{timing}"
    if not result.boundary_reached:
        row.note += f"; boundary not reached ({result.stop_reason})"
    return row


def _allocator_facts(trial: Any) -> dict[str, Any] | None:
    """``Trial.allocator`` (retries, split-free peak, ...) where this batchfit records it."""
    facts = getattr(trial, "allocator", None)
    if facts is None:
        return None
    with contextlib.suppress(TypeError):
        return asdict(facts)
    return {"repr": repr(facts)}


def run_lightning(model: Model, device: torch.device) -> Row:
    """Lightning's ``binsearch`` with its defaults, driven (and capped) by ``compare.py``."""
    if not compare.lightning_available():
        return Row("Lightning", "binsearch", skipped="lightning (or pytorch_lightning) is not installed")
    peer = compare.run_lightning(model.case(), device, PEER_STEPS, "binsearch", None, None)
    row = peer_row(peer, "Lightning", "binsearch, defaults (margin 0.05)")
    largest = max((s for s, f in zip(peer.sizes, peer.fits) if f), default=None)
    row.extra["largest_fitting_trial"] = largest
    row.note = "; ".join(filter(None, [f"largest size its trials trained: {largest}", peer.note]))
    return row


def run_accelerate(model: Model, device: torch.device) -> Row:
    """Accelerate's decorator from its default start, driven (and capped) by ``compare.py``."""
    if not compare.accelerate_available():
        return Row("Accelerate", "decorator", skipped="accelerate is not installed")
    peer = compare.run_accelerate(model.case(), device, PEER_STEPS, ACCELERATE_START, "default")
    return peer_row(peer, "Accelerate", f"decorator, starting_batch_size={ACCELERATE_START}")


def peer_row(peer: compare.Row, finder: str, setting: str) -> Row:
    return Row(
        finder,
        setting,
        answer=peer.found,
        trials=peer.trials,
        ooms=peer.ooms,
        wall_s=peer.wall_s,
        sizes=list(peer.sizes),
        fits=list(peer.fits),
        note=peer.note,
    )


def add_ratios(rows: list[Row]) -> None:
    """Every row's wall time and trials as a multiple of Lightning's."""
    lightning = next((r for r in rows if r.finder == "Lightning" and not r.skipped and r.wall_s), None)
    if lightning is None:
        return
    for row in rows:
        if row.wall_s is not None and lightning.wall_s:
            row.x_lightning_wall = row.wall_s / lightning.wall_s
        if row.trials is not None and lightning.trials:
            row.x_lightning_trials = row.trials / lightning.trials


# The Lightning package on the GPU box ------------------------------------------------------------------
def lightning_alias() -> str | None:
    """Make ``lightning.pytorch`` importable where only ``pytorch_lightning`` is installed (the GPU box
    has the ``pytorch-lightning`` distribution; ``compare.py`` imports ``lightning.pytorch``): every
    loaded ``pytorch_lightning`` module is registered under the other name too, the same objects, so
    nothing is loaded twice. Returns which package serves ``lightning.pytorch`` (``None``: neither)."""
    if importlib.util.find_spec("lightning") is not None:
        return "lightning"
    if importlib.util.find_spec("pytorch_lightning") is None:
        return None
    import pytorch_lightning
    import pytorch_lightning.tuner  # noqa: F401  (what compare.py imports from it)
    import pytorch_lightning.utilities.memory  # noqa: F401

    stub = types.ModuleType("lightning")
    stub.__spec__ = importlib.machinery.ModuleSpec("lightning", None, is_package=True)
    stub.__path__ = []  # type: ignore[attr-defined]
    stub.__version__ = pytorch_lightning.__version__  # type: ignore[attr-defined]
    stub.pytorch = pytorch_lightning  # type: ignore[attr-defined]
    sys.modules["lightning"] = stub
    for name, module in list(sys.modules.items()):
        if name == "pytorch_lightning" or name.startswith("pytorch_lightning."):
            sys.modules["lightning.pytorch" + name[len("pytorch_lightning") :]] = module
    return "pytorch_lightning"


# Fresh processes ---------------------------------------------------------------------------------------
def child_env(device: torch.device) -> dict[str, str]:
    """This tree importable; on CPU no GPU and one thread per child (they run two at a time). The
    allocator configuration is the parent's: the children judge under what the finders ran under."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    if device.type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = "1"
    return env


def answer_of(output: str) -> dict[str, Any] | None:
    """A child's answer: its last line that starts with :data:`MARK`."""
    marked = [line for line in output.splitlines() if line.startswith(MARK)]
    if not marked:
        return None
    try:
        return json.loads(marked[-1][len(MARK) :])
    except json.JSONDecodeError:
        return None


def fresh_child(model: Model, device: torch.device, size: int) -> tuple[dict[str, Any], str]:
    """``python3 benchmarks/gpu.py --child train`` at ``size``: its answer and its output."""
    args = {
        "device": "cuda" if device.type == "cuda" else "cpu",
        "case": model.child_case(),
        "size": size,
        "steps": FRESH_STEPS,
    }
    argv = [sys.executable, str(HERE / "gpu.py"), "--child", "train", "--args", json.dumps(args)]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            argv,
            cwd=ROOT,
            env=child_env(device),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT[device.type],
        )
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = _text(exc.stdout) + _text(exc.stderr) + f"\n[stopped after {CHILD_TIMEOUT[device.type]} s]"
        code = None
    answer = answer_of(output) or {"ok": False, "error": f"exit {code}, no answer: {output.strip()[-300:]}"}
    answer.pop("step_times_s", None)
    answer["exit_code"], answer["wall_s"] = code, time.perf_counter() - started
    return answer, output


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def fits_of(answer: dict[str, Any] | None) -> bool | None:
    """A child's verdict: ``fits`` of an answer that came back, ``None`` otherwise."""
    if not answer or not answer.get("ok") or not isinstance(answer.get("fits"), bool):
        return None
    return answer["fits"]


def sizes_to_judge(rows: Iterable[Row]) -> list[int]:
    """Every answer and the size above it, and batchfit's safe batch: each once."""
    sizes: set[int] = set()
    for row in rows:
        if row.answer is not None and not row.skipped:
            sizes.update((row.answer, row.answer + 1))
        safe = row.extra.get("safe_batch")
        if isinstance(safe, int):
            sizes.add(safe)
    return sorted(s for s in sizes if s >= 1)


def lanes_for(model: Model, device: torch.device) -> int:
    """How many children run at once: on CPU two (two cores, one thread each); on CUDA as many caps
    (and a context each) as the free memory holds, at most 4."""
    if device.type != "cuda":
        return 2
    compare.release(device)
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(4, int((free - 2 * GiB) // (model.cap_bytes + 2 * GiB))))


def judge(model: Model, device: torch.device, rows: list[Row], log: list[str]) -> tuple[dict[int, dict[str, Any]], int]:
    """Fresh children at every size to judge; each row's verdict from them."""
    sizes = sizes_to_judge(rows)
    lanes = lanes_for(model, device)
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        done = list(pool.map(lambda size: (size, *fresh_child(model, device, size)), sizes))
    answers: dict[int, dict[str, Any]] = {}
    for size, answer, output in done:
        answers[size] = answer
        log.append(f"===== {model.label}: train child at {size} (exit {answer.get('exit_code')}) =====")
        log.append(output[-6000:])
    apply_verdicts(rows, answers)
    return answers, lanes


def apply_verdicts(rows: list[Row], answers: dict[int, dict[str, Any]]) -> None:
    for row in rows:
        if row.skipped or row.answer is None:
            row.verdict = None if row.skipped else "no answer"
            continue
        row.fresh_at = fits_of(answers.get(row.answer))
        row.fresh_above = fits_of(answers.get(row.answer + 1))
        row.verdict = verdict(row.answer, row.fresh_at, row.fresh_above)
        safe = row.extra.get("safe_batch")
        if isinstance(safe, int):
            row.extra["safe_fresh_fits"] = fits_of(answers.get(safe))


# The profile -------------------------------------------------------------------------------------------
#: A function in ``pstats``: (file, line, name); C functions are ``("~", 0, "<built-in method gc.collect>")``.
Key = tuple[str, int, str]
#: ``{function: (primitive calls, calls, own seconds, cumulative seconds, {caller: (.., .., own, cumulative)})}``
Stats = dict[Key, tuple[Any, ...]]

#: Where ``find()``'s time goes, in order: each moment of its wall time goes to the first bucket
#: with a function of it on the call stack (a ``synchronize`` inside the steps counts as steps; a
#: ``gc.collect`` inside a trial's release as ``gc.collect``); what none holds is "the rest".
#: A function matches ``(path fragment, name)`` when its file contains the fragment and its name is
#: the name (for C functions, file ``~``, when the name contains it).
BUCKETS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("steps (trial._run_steps)", (("batchfit/probe/trial.py", "_run_steps"),)),
    (
        "warm-ups (CudaBackend.warm_up, cuBLAS workspaces)",
        (("batchfit/backends/", "warm_up"), ("~", "_cuda_clearCublasWorkspaces")),
    ),
    ("gc.collect", (("~", "gc.collect"),)),
    ("torch.cuda.empty_cache", (("torch/cuda/memory.py", "empty_cache"),)),
    ("torch.cuda.synchronize", (("torch/cuda/__init__.py", "synchronize"),)),
    (
        "trial release, OOM recovery",
        (
            ("batchfit/probe/trial.py", "_flush_autograd"),
            ("batchfit/probe/trial.py", "_drop_grads"),
            ("batchfit/backends/", "release"),
        ),
    ),
)


def matches(key: Key, fragment: str, name: str) -> bool:
    path, _, function = key
    path = path.replace("\\", "/")
    if fragment == "~":
        return path == "~" and name in function
    return fragment in path and function == name


def roots_of(stats: Stats, matchers: Iterable[tuple[str, str]]) -> set[Key]:
    pairs = list(matchers)
    return {key for key in stats if any(matches(key, fragment, name) for fragment, name in pairs)}


def components(stats: Stats) -> tuple[dict[Key, int], list[list[Key]]]:
    """The strongly connected components of the call graph (a recursion, or the mutual one of
    ``Module._call_impl`` and the ``forward`` it calls, is one component), callers' components
    before their callees': ``(component of each function, components in that order)``.

    Tarjan's algorithm, iterative, on the graph whose edges go from a function to its callers:
    it emits a component after every component it reaches, i.e. after its callers'."""
    index: dict[Key, int] = {}
    low: dict[Key, int] = {}
    on_stack: set[Key] = set()
    stack: list[Key] = []
    order: list[list[Key]] = []

    def callers(key: Key) -> list[Key]:
        return [caller for caller in stats[key][4] if caller in stats and caller != key]

    for start in stats:
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(callers(start)))]
        while work:
            node, pending = work[-1]
            for nxt in pending:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(callers(nxt))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    order.append(members)
    component = {key: number for number, members in enumerate(order) for key in members}
    return component, order


def under_share(stats: Stats, roots: set[Key]) -> dict[Key, float]:
    """For every function, the fraction of its cumulative time spent with one of ``roots`` above it
    on the stack, from the callers' cumulative times as gprof splits them (exact for direct
    callers, proportional beyond them; inside a recursion, the share its entries from outside carry)."""
    _, order = components(stats)
    share: dict[Key, float] = {}
    for members in order:  # every caller outside the component already has its share
        group = set(members)
        entered = weighted = 0.0
        for member in members:
            for caller, edge in stats[member][4].items():
                if caller in group or caller not in stats:
                    continue
                entered += edge[3]
                weighted += edge[3] * (1.0 if caller in roots else share[caller])
        inherited = weighted / entered if entered > 0 else 0.0
        for member in members:
            total = part = 0.0
            for caller, edge in stats[member][4].items():
                if caller == member or caller not in stats:
                    continue
                total += edge[3]
                if caller in roots:
                    part += edge[3]
                else:
                    part += edge[3] * (inherited if caller in group else share[caller])
            share[member] = min(1.0, max(0.0, part / total)) if total > 0 else 0.0
    return share


def covered_s(stats: Stats, roots: set[Key]) -> float:
    """Seconds with any of ``roots`` on the stack (each counted where the outermost one entered)."""
    share = under_share(stats, roots)
    return sum(stats[root][3] * (1.0 - share[root]) for root in roots)


def through_s(stats: Stats, targets: set[Key]) -> dict[Key, float]:
    """For every function, the seconds of ``targets``' time spent below (or in) it: the targets'
    time carried up to their callers in proportion to each caller's cumulative time in them (a
    recursion's members share their component's)."""
    share = under_share(stats, targets)
    component, order = components(stats)
    flow: dict[int, float] = defaultdict(float)
    for target in targets:
        flow[component[target]] += stats[target][3] * (1.0 - share[target])
    for number in range(len(order) - 1, -1, -1):  # callees' components first
        amount = flow.get(number, 0.0)
        if amount <= 0:
            continue
        group = set(order[number])
        edges = [
            (caller, edge[3])
            for member in order[number]
            for caller, edge in stats[member][4].items()
            if caller not in group and caller in stats and edge[3] > 0
        ]
        entered = sum(seconds for _, seconds in edges)
        for caller, seconds in edges:
            flow[component[caller]] += amount * seconds / entered
    return {key: flow.get(component[key], 0.0) for key in stats}


#: A batchfit function whose time outside the steps goes to one batchfit callee for at least this
#: share is left out of the profile's list of costs (the callee stands for it).
PASS_THROUGH = 0.95


def bucket_profile(stats: Stats, wall_s: float, top: int = 12) -> dict[str, Any]:
    """``find()``'s wall time split into :data:`BUCKETS` and the rest (see there), the cumulative
    seconds of each bucket's functions as ``pstats`` reports them (nested calls counted again), and
    the batchfit functions and the functions of any kind that cost the most outside the steps (the
    batchfit ones by their cumulative time outside the steps, less those that pass it on)."""
    buckets, seen, before = [], set(), 0.0
    for name, matchers in BUCKETS:
        roots = roots_of(stats, matchers)
        seen |= roots
        now = covered_s(stats, seen)
        buckets.append(
            {
                "bucket": name,
                "seconds": max(0.0, now - before),
                "cumulative_s": sum(stats[r][3] for r in roots),
                "calls": sum(stats[r][1] for r in roots),
                "functions": sorted(_name(r) for r in roots),
            }
        )
        before = max(before, now)
    rest = max(0.0, wall_s - before)
    buckets.append({"bucket": "rest", "seconds": rest, "cumulative_s": None, "calls": None, "functions": []})
    for bucket in buckets:
        bucket["share"] = bucket["seconds"] / wall_s if wall_s > 0 else None
    steps = roots_of(stats, BUCKETS[0][1])
    in_steps = under_share(stats, steps)
    below = through_s(stats, steps)
    outside: dict[Key, float] = {}
    for key, entry in stats.items():
        if key in steps or "batchfit/" not in key[0].replace("\\", "/"):
            continue
        seconds = entry[3] * (1.0 - in_steps[key]) - below.get(key, 0.0)
        if seconds > 0:
            outside[key] = seconds
    # A function that hands (nearly) all of its time outside the steps to one batchfit callee
    # (find -> find_with -> search_with -> ...) passes it through: the callee is the one to read.
    handed: dict[Key, float] = defaultdict(float)
    for callee, entry in stats.items():
        for caller, edge in entry[4].items():
            if caller in outside and callee in outside and caller != callee:
                handed[caller] = max(handed[caller], min(outside[callee], edge[3]))
    outside_cumulative = [
        {"function": _name(key), "seconds": seconds, "calls": stats[key][1]}
        for key, seconds in outside.items()
        if handed.get(key, 0.0) < PASS_THROUGH * seconds
    ]
    outside_self = []
    for key, entry in stats.items():
        if key in steps:
            continue
        seconds = entry[2] * (1.0 - in_steps[key])
        if seconds > 0:
            outside_self.append({"function": _name(key), "seconds": seconds, "calls": entry[1]})
    steps_s = buckets[0]["seconds"]
    return {
        "wall_s": wall_s,
        "steps_s": steps_s,
        "outside_steps_s": max(0.0, wall_s - steps_s),
        "buckets": buckets,
        "top_batchfit_outside_steps": sorted(outside_cumulative, key=lambda r: -r["seconds"])[:top],
        "top_self_outside_steps": sorted(outside_self, key=lambda r: -r["seconds"])[:top],
    }


def _name(key: Key) -> str:
    path, line, function = key
    if path == "~":
        return function
    path = path.replace("\\", "/")
    for marker in ("/batchfit/", "/torch/", "/site-packages/", "/lib/python"):
        if marker in path:
            path = path[path.index(marker) + 1 :]
            break
    return f"{path}:{line}({function})"


def profile_find(model: Model, device: torch.device) -> tuple[dict[str, Any], str]:
    """One whole-answer ``find()`` under ``cProfile``: its buckets, and ``pstats``' own text."""
    net, sample = model.case().build()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    try:
        result = batchfit.find(net, sample, memory_limit=model.cap_bytes, device=device, amp=model.amp)
    finally:
        profiler.disable()
    wall = time.perf_counter() - started
    del net, sample
    compare.release(device)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    summary = bucket_profile(stats.stats, wall)  # type: ignore[attr-defined]
    summary.update(max_batch=result.max_batch, trials=len(result.trials), elapsed_s=result.elapsed_s)
    stats.sort_stats("cumulative").print_stats(45)
    return summary, f"===== {model.label}: find() under cProfile, {wall:.2f} s =====\n{text.getvalue()}"


# One model ---------------------------------------------------------------------------------------------
class Clock:
    """The run's deadline: no step starts after it."""

    def __init__(self, deadline_s: float) -> None:
        self.started = time.perf_counter()
        self.deadline_s = deadline_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def late(self) -> str | None:
        if self.elapsed() > self.deadline_s:
            return f"skipped: would start at {self.elapsed():.0f} s, after the {self.deadline_s:.0f} s deadline"
        return None


def run_model(model: Model, device: torch.device, clock: Clock, log: list[str], profiles: list[str]) -> dict[str, Any]:
    print(f"\n== {model.label} ==", flush=True)
    load, cpu_at_start = compare._load(), compare._cpu_snapshot()
    rows: list[Row] = []
    results: dict[str, Any] = {}
    steps: list[tuple[str, str, Callable[[], Row]]] = [
        ("batchfit", "find() defaults: whole answer", lambda: _find(model, device, "whole", results)),
        ("batchfit", "find(timed_steps=0): memory answer", lambda: _find(model, device, "memory", results)),
        ("Lightning", "binsearch", lambda: run_lightning(model, device)),
        ("Accelerate", "decorator", lambda: run_accelerate(model, device)),
    ]
    for finder, setting, step in steps:
        late = clock.late()
        if late:
            rows.append(Row(finder, setting, skipped=late))
            print(f"   {finder} {setting}: {late}", flush=True)
            continue
        row = _guarded(step, finder, setting, device)
        rows.append(row)
        shown = "-" if row.wall_s is None else f"{row.wall_s:.1f} s"
        print(f"   {finder} {row.setting}: {row.answer} in {row.trials} trials, {shown}  {row.note}", flush=True)
    add_ratios(rows)
    document: dict[str, Any] = {
        "model": model.key,
        "case": model.label,
        "factory": model.factory,
        "kwargs": model.kwargs,
        "amp": model.amp,
        "cap_bytes": model.cap_bytes,
        "fresh": {},
        "fresh_lanes": None,
        "fresh_skipped": None,
        "profile": None,
        "profile_skipped": None,
    }
    late = clock.late()
    if late:
        document["fresh_skipped"] = late
        apply_verdicts(rows, {})
    else:
        began = time.perf_counter()
        answers, lanes = judge(model, device, rows, log)
        document["fresh"] = {str(size): answer for size, answer in answers.items()}
        document["fresh_lanes"], document["fresh_wall_s"] = lanes, time.perf_counter() - began
        said = ", ".join(f"{s}: {_fits_word(fits_of(a))}" for s, a in answers.items())
        print(f"   fresh children ({lanes} at a time, {document['fresh_wall_s']:.0f} s): {said}", flush=True)
    late = clock.late()
    if late:
        document["profile_skipped"] = late
    else:
        try:
            document["profile"], text = profile_find(model, device)
            profiles.append(text)
            print(f"   profiled find(): {document['profile']['wall_s']:.1f} s under cProfile", flush=True)
        except Exception as exc:  # the profile is information: the comparison stands without it
            document["profile_skipped"] = compare.raised(exc)
    document["rows"] = [asdict(row) for row in rows]
    document["results"] = results
    document["load_average_1min"] = {"start": load, "end": compare._load()}
    document["others_cpu_share"] = compare.others_cpu_share(cpu_at_start)
    return document


def _find(model: Model, device: torch.device, which: str, results: dict[str, Any]) -> Row:
    options = {} if which == "whole" else {"timed_steps": 0}
    setting = "find() defaults: whole answer" if which == "whole" else "find(timed_steps=0): memory answer"
    row, result = run_find(model, device, setting, **options)
    results[which] = json.loads(result.to_json())
    return row


def _guarded(step: Callable[[], Row], finder: str, setting: str, device: torch.device) -> Row:
    """A finder that raised gets a row that says so (its traceback, and the tensors its frames hold,
    dropped); the run goes on."""
    try:
        return step()
    except Exception as exc:
        row = Row(finder, setting, note=compare.raised(exc))
    compare.release(device)
    return row


def _fits_word(fits: bool | None) -> str:
    return {True: "fits", False: "OOM", None: "?"}[fits]


# Output ------------------------------------------------------------------------------------------------
COLUMNS = (
    ("finder", "<10"),
    ("setting", "<37"),
    ("answer", ">6"),
    ("trials", ">6"),
    ("OOMs", ">4"),
    ("wall s", ">7"),
    ("x L wall", ">8"),
    ("x L trials", ">10"),
    ("fresh b / b+1", "<13"),
    ("verdict", "<9"),
)


def _line(cells: list[str], note: str = "") -> str:
    text = " ".join(f"{cell[:37]:{spec}}" for cell, (_, spec) in zip(cells, COLUMNS))
    return (text + ("  " + note if note else "")).rstrip()


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_model(case: dict[str, Any]) -> list[str]:
    """The table of one model (from its JSON document)."""
    others = case.get("others_cpu_share")
    busy = "" if others is None else f"; other processes used {others:.0%} of the cores meanwhile"
    lines = [f"{case['case']}: fresh children judge b and b+1 ({FRESH_STEPS}-step plain loop under the cap){busy}"]
    lines.append(_line([name for name, _ in COLUMNS], "note"))
    for row in case["rows"]:
        if row["skipped"]:
            lines.append(_line([row["finder"], row["setting"]] + ["-"] * 8, row["skipped"]))
            continue
        fresh = "-"
        if row["answer"] is not None and (row["fresh_at"] is not None or row["fresh_above"] is not None):
            fresh = f"{_fits_word(row['fresh_at'])} / {_fits_word(row['fresh_above'])}"
        note = row["note"]
        safe_fits = row["extra"].get("safe_fresh_fits")
        if "safe_batch" in row["extra"] and safe_fits is not None:
            note = f"{note}; safe {row['extra']['safe_batch']} fresh: {_fits_word(safe_fits)}"
        cells = [
            row["finder"],
            row["setting"],
            "-" if row["answer"] is None else str(row["answer"]),
            "-" if row["trials"] is None else str(row["trials"]),
            "-" if row["ooms"] is None else str(row["ooms"]),
            _num(row["wall_s"], ".1f"),
            _num(row["x_lightning_wall"], ".2f"),
            _num(row["x_lightning_trials"], ".2f"),
            fresh,
            row["verdict"] or "-",
        ]
        lines.append(_line(cells, note))
    if case.get("fresh_skipped"):
        lines.append(f"fresh children: {case['fresh_skipped']}")
    lines += render_profile(case.get("profile"), case.get("profile_skipped"))
    return lines


def render_profile(profile: dict[str, Any] | None, skipped: str | None = None) -> list[str]:
    if profile is None:
        return [f"find() profile: {skipped or 'not run'}"]
    lines = [
        f"find() under cProfile: {profile['wall_s']:.2f} s wall (the profiler slows Python), "
        f"{profile['steps_s']:.2f} s in the steps, {profile['outside_steps_s']:.2f} s outside them:"
    ]
    lines.append(f"  {'where':<52} {'seconds':>8} {'share':>6} {'cumulative':>11} {'calls':>6}")
    for bucket in profile["buckets"]:
        share = "-" if bucket["share"] is None else f"{bucket['share']:.0%}"
        calls = "-" if bucket["calls"] is None else str(bucket["calls"])
        lines.append(
            f"  {bucket['bucket']:<52} {bucket['seconds']:>8.2f} {share:>6} "
            f"{_num(bucket['cumulative_s'], '.2f'):>11} {calls:>6}"
        )
    tops = profile.get("top_batchfit_outside_steps") or []
    if tops:
        lines.append("  batchfit functions outside the steps (cumulative s): " + _tops(tops[:6]))
    selfs = profile.get("top_self_outside_steps") or []
    if selfs:
        lines.append("  own time outside the steps (s): " + _tops(selfs[:6]))
    return lines


def _tops(entries: list[dict[str, Any]]) -> str:
    return "; ".join(f"{_short(e['function'])} {e['seconds']:.2f}" for e in entries)


def _short(function: str) -> str:
    """``batchfit/probe/prober.py:300(_undo)`` -> ``prober._undo``."""
    match = re.match(r"(?:.*/)?([\w.]+?)(?:\.py)?:\d+\((.+)\)$", function)
    return f"{match.group(1)}.{match.group(2)}" if match else function


def goal_lines(cases: list[dict[str, Any]]) -> list[str]:
    """The issue's goal, per model: the whole answer's wall against Lightning's, and who is exact."""
    lines = [
        f"goal (issue 47 item 7): batchfit's whole answer <= {GOAL_RATIO}x Lightning's wall, exact where it is not"
    ]
    for case in cases:
        rows = {(r["finder"], r["setting"].split(":")[-1].strip()): r for r in case["rows"]}
        whole = rows.get(("batchfit", "whole answer"))
        memory = rows.get(("batchfit", "memory answer"))
        lightning = next((r for r in case["rows"] if r["finder"] == "Lightning"), None)
        accelerate = next((r for r in case["rows"] if r["finder"] == "Accelerate"), None)
        ratio = None if whole is None else whole.get("x_lightning_wall")
        if ratio is None:
            lines.append(f"  {case['model']}: no ratio (a row is missing or was skipped)")
            continue
        memory_ratio = None if memory is None else memory.get("x_lightning_wall")
        exact = whole.get("verdict") == "exact"
        met = ratio <= GOAL_RATIO and (exact or (lightning or {}).get("verdict") != "exact")
        lines.append(
            f"  {case['model']}: whole answer {ratio:.2f}x Lightning's wall (memory answer "
            f"{_num(memory_ratio, '.2f')}x), trials {_num(whole.get('x_lightning_trials'), '.2f')}x; "
            f"verdicts batchfit {whole.get('verdict')}, Lightning {(lightning or {}).get('verdict')}, "
            f"Accelerate {(accelerate or {}).get('verdict')} -> {'MET' if met else 'not met'}"
        )
    return lines


def render(document: dict[str, Any]) -> str:
    """The whole table (what is printed and written as ``.txt``), from the JSON document."""
    machine = document.get("machine", {})
    where = machine.get("gpu") or machine.get("cpu") or document.get("device")
    lines = [
        f"batchfit vs Lightning vs Accelerate on {document.get('device')} ({where}), {document.get('date')}",
        f"versions {document.get('versions')}; allocator {document.get('allocator')}; "
        f"lightning from {document.get('lightning_package')}",
        "",
    ]
    for case in document.get("cases", []):
        lines += render_model(case) + [""]
    for label in document.get("skipped_models", []):
        lines.append(f"{label}: skipped (deadline)")
    lines += goal_lines(document.get("cases", []))
    lines.append(f"total {document.get('total_wall_s', 0):.0f} s")
    return "\n".join(lines)


def machine(device: torch.device) -> dict[str, Any]:
    info = compare.machine()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_total_bytes=int(props.total_memory))
    else:
        info.pop("gpu", None)
    return info


def warm_up_process(device: torch.device) -> None:
    """What every training process pays once, paid before any finder is timed: the peers' imports,
    torch's first optimizer (it imports ``torch._dynamo``), the CUDA context and cuBLAS."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    if compare.lightning_available():
        import lightning.pytorch  # noqa: F401
        import lightning.pytorch.tuner  # noqa: F401
    if compare.accelerate_available():
        import accelerate.utils  # noqa: F401
    if device.type == "cuda":
        x = torch.ones(64, 64, device=device, requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            (x @ x).float().sum().backward()
        torch.cuda.synchronize(device)
        del x
        compare.release(device)


# Main --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=compare.RESULTS, help="folder for the files (default benchmarks/results/)"
    )
    parser.add_argument("--deadline", type=float, help="seconds after which no step starts (420 on CUDA, 150 on CPU)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="cpu: the CPU run anywhere")
    parser.add_argument("--models", default="", help="comma-separated keys of the models to run (default: all)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device here")
    cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    clock = Clock(args.deadline if args.deadline is not None else DEADLINES[device.type])
    package = lightning_alias()
    models = gpu_models(torch.cuda.get_device_properties(device).total_memory) if cuda else list(CPU_MODELS)
    wanted = [k.strip() for k in args.models.split(",") if k.strip()]
    models = [m for m in models if not wanted or m.key in wanted]
    allocator = getattr(torch.cuda, "get_allocator_backend", lambda: None)() if cuda else None
    document: dict[str, Any] = {
        "schema": "batchfit.gpu-compare/1",
        **compare.stamp(argv, str(device)),
        "machine": machine(device),
        "versions": compare.versions(),
        "lightning_package": package,
        "allocator": allocator,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
        "deadline_s": clock.deadline_s,
        "peer_steps": PEER_STEPS,
        "accelerate_start": ACCELERATE_START,
        "fresh_steps": FRESH_STEPS,
    }
    where = document["machine"].get("gpu") or document["machine"]["cpu"]
    print(f"gpu_compare on {device} ({where}); versions {document['versions']}; lightning from {package}", flush=True)
    warm_up_process(device)
    log: list[str] = []
    profiles: list[str] = []
    cases: list[dict[str, Any]] = []
    skipped: list[str] = []
    stem = args.out / f"gpu-compare-{device.type}-{_dt.datetime.now():%Y%m%d-%H%M%S}"
    for number, model in enumerate(models):
        if clock.late():
            skipped.append(model.label)
            print(f"\n== {model.label} == {clock.late()}", flush=True)
            continue
        cases.append(run_model(model, device, clock, log, profiles))
        if number < len(models) - 1:  # what a run stopped from outside leaves: every model done so far
            finish(document, cases, skipped, clock, log, profiles, stem)
    text, written = finish(document, cases, skipped, clock, log, profiles, stem)
    print("\n" + text, flush=True)
    print("wrote " + ", ".join(str(p) for p in written), flush=True)
    return document


def finish(
    document: dict[str, Any],
    cases: list[dict[str, Any]],
    skipped: list[str],
    clock: Clock,
    log: list[str],
    profiles: list[str],
    stem: Path,
) -> tuple[str, list[Path]]:
    """The document completed with what ran so far, its table, and the files written."""
    document.update(cases=cases, skipped_models=skipped, total_wall_s=clock.elapsed(), goal=goal_lines(cases))
    text = render(document)
    return text, write(document, text, log, profiles, stem)


def write(document: dict[str, Any], text: str, log: list[str], profiles: list[str], stem: Path) -> list[Path]:
    """The four files of a run (a GPU box sends back at most 8), ``stem`` + ``.json``, ``.txt``, ..."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    files = {
        Path(f"{stem}.json"): json.dumps(document, indent=1, default=str) + "\n",
        Path(f"{stem}.txt"): text + "\n",
        Path(f"{stem}-profile.txt"): "\n".join(profiles) + "\n",
        Path(f"{stem}-children.log"): "\n".join(log) + "\n",
    }
    for path, content in files.items():
        path.write_text(content)
    return list(files)


if __name__ == "__main__":
    main()
