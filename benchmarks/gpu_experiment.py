"""Which definition of "batch b fits" holds between batchfit's probe and a fresh training process,
decided on the card in one GPU call (issue 47, items 1 and 6).

Three proof runs on an H200 (``benchmarks/results/2026-11-26-nvidia-h200*/``) found batchfit's
answer one batch off a fresh process, in both directions, in ways that differ per allocator.
Before one rule is built into every trial, this script measures the candidates against what fresh
processes do, all in one command of at most 9 minutes, because a GPU is lent for minutes at a
time::

    python3 benchmarks/gpu_experiment.py --out "$OUT"            # on the GPU box (520 s deadline)
    python3 benchmarks/gpu_experiment.py --device cpu --out DIR   # the CPU run, anywhere (~45 s on 2 cores)
    python3 benchmarks/gpu_experiment.py --render DIR/experiment.json   # its verdict again, judged anew

The case is the proof's: GPT-2-small (sequence 1024, bf16 autocast) under a 24 GiB cap on CUDA
(``set_per_process_memory_fraction(cap / total)``, the native allocator). What runs, each part in
fresh processes (``--child``; this process never imports torch, so it holds no CUDA context):

1. ``find()`` once for its max M (native), and once under ``backend:cudaMallocAsync`` (its own M).
2. Fresh children at M-1, M and M+1, without and with the probe's cuBLAS warm-up before the cap:
   a plain AdamW loop of 10 steps, recording after every step the allocator's retries, the
   allocated and reserved peaks and the split-free (``inactive_split_bytes``) peak; at an
   out-of-memory its phase, message and a summary of ``torch.cuda.memory_snapshot()``.
3. The replay variants inside ONE ``batchfit.Prober`` at M-1..M+1: ``trial(b)`` (warm),
   ``trial(b, fresh_optimizer=True)`` and ``trial(b, from_scratch=True)`` (``not available``
   where this batchfit has no such keyword yet), with ``Trial.allocator`` where there is one.
4. Two fresh ``cudaMallocAsync`` processes per size at its own M-1..M+1: requested (allocated)
   and reserved peaks, the pool's overhead, and whether the two processes agree.
5. 200 steps at ``find()``'s safe batch with the sequence length cycling 1024/960/1024/896,
   under the native allocator and under ``expandable_segments:True``: retries, reserved and
   split-free bytes per 20 steps, a memory snapshot summary at every out-of-memory.

Children run in parallel where the card's free memory (read once, at the start) holds each one's
cap plus its CUDA context; no child starts after ``--deadline``, and the verdict names what did
not run. It ends with one screen (``experiment.txt``): for each candidate rule, does its answer at
M-1, M, M+1 equal what the fresh processes did, judged by the fresh-process rule (issue 47 item 1):

* native: fits iff no step ran out of memory AND the allocator's retries did not grow;
* ``expandable_segments:True``, ``cudaMallocAsync``: fits iff no step ran out of memory.

The candidates: (a) today's probe, a warm trial and a 2-step fresh-optimizer confirmation;
(b) the replay of a fresh process in one prober, judged on out-of-memory only; (c) the same
judged on out-of-memory and no retry; (d) under ``cudaMallocAsync``, the probe's requested bytes
(its ``find()``'s M) against fresh async processes.

Files in ``--out`` (a GPU box sends back 8): ``experiment.txt``, ``experiment.json`` (every
record) and ``experiment-logs.tar.gz`` (every child's log). Without CUDA the same script runs on
CPU with the proof's small GPT under batchfit's live-tensor limit, so that CI runs it exactly as
the GPU box does; the CUDA-only parts (async, expandable segments, the warm-up, snapshots) are
then reported as not run for lack of CUDA, never faked. Exit code 0 when every child that started
gave an answer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# batchfit from this source tree (a GPU box has it not installed); proof_children from beside us.
for _path in (str(HERE), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from proof_children import MARK, build, emit, first_line, loss_of, tile  # noqa: E402

RESULTS = HERE / "results"
#: The two other allocator configurations (``PYTORCH_CUDA_ALLOC_CONF``).
ASYNC, EXPANDABLE = "backend:cudaMallocAsync", "expandable_segments:True"
GiB, MiB = 2**30, 2**20
#: The sizes tried around a max M, by their offset, and how the text names them.
OFFSETS = {-1: "M-1", 0: "M", 1: "M+1"}
#: Memory a child needs beyond its cap: its CUDA context and kernels (outside the allocator),
#: more under ``cudaMallocAsync``, whose pool may hold more than the bytes the fraction counts.
CONTEXT_BYTES, ASYNC_EXTRA_BYTES = int(1.5 * GiB), 2 * GiB
#: A child that saw less of the card free than this may have met the card's end, not its cap (a
#: failed ``cudaMalloc`` is also an allocator retry): the verdict warns.
CARD_FULL_BYTES = 1 * GiB
#: Seconds a child may run past ``--deadline`` (then SIGINT: it writes what it has), and after
#: SIGINT before SIGKILL: the whole run ends within about ``deadline + 15 s``.
GRACE_S, INTERRUPT_GRACE_S = 8.0, 6.0
#: ``RuntimeError`` words of an out-of-memory in cuBLAS/cuDNN's words (not a ``torch.OutOfMemoryError``).
OOM_WORDS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC")
#: What the message of a trial failed by the retry rule says (``batchfit.backends.allocator_rule``).
REFUSAL_WORDS = "allocator retry"
#: Out-of-memory errors after which the long run stops (each is recorded with its snapshot).
MAX_LONG_OOMS = 8
#: Large segments listed per snapshot (the rest, and all small ones, are summed).
SNAPSHOT_ROWS = 24
RULES = {
    "a": "today's probe: warm trial + 2-step fresh-optimizer confirmation",
    "b": "replay from scratch in one prober, judged on OOM only",
    "c": "replay from scratch, judged on OOM + no allocator retry",
    "d": "cudaMallocAsync: the probe's requested bytes (its find() max)",
}
#: The same in a table's width.
SHORT_RULES = {
    "a": "today: warm + 2-step confirm",
    "b": "replay, OOM only",
    "c": "replay, OOM + no retry",
    "d": "async: requested bytes",
}


# ================================================================================================
# The children: each runs in a fresh interpreter (``--child NAME --args JSON``) and emits one line.
# ================================================================================================
def allocator_kind(device: str) -> str:
    """The allocator this process runs under, by the names of the fit rule."""
    import torch

    if device != "cuda" or not torch.cuda.is_available():
        return "cpu"
    if getattr(torch.cuda, "get_allocator_backend", lambda: "native")() == "cudaMallocAsync":
        return "cudaMallocAsync"
    conf = ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return "expandable" if "expandable_segments:true" in conf.replace(" ", "").lower() else "native"


def child_describe(args: dict[str, Any]) -> dict[str, Any]:
    """The machine, and the card's free memory (read once: it decides how many children run at once)."""
    import torch

    import batchfit

    cuda = args["device"] != "cpu" and torch.cuda.is_available()
    info: dict[str, Any] = {
        "cuda": cuda,
        "batchfit_from": str(Path(batchfit.__file__).resolve().parent),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    if cuda:
        free, total = torch.cuda.mem_get_info(0)
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, total_bytes=total, free_bytes=free, capability=f"{props.major}.{props.minor}")
    return info


def trial_facts(trial: Any) -> dict[str, Any]:
    """A ``Trial`` as the verdict reads it, with ``Trial.allocator`` where this batchfit has it."""
    facts = getattr(trial, "allocator", None)
    if facts is not None and dataclasses.is_dataclass(facts):
        facts = dataclasses.asdict(facts)
    return {
        "batch": trial.batch_size,
        "kind": trial.kind,
        "fits": trial.fits,
        "steps": trial.steps,
        "phase": trial.phase,
        "message": (trial.message or "")[:240] or None,
        "peak_bytes": trial.peak_bytes,
        "reserved_peak_bytes": trial.reserved_peak_bytes,
        "allocator": facts,
    }


def child_find(args: dict[str, Any]) -> dict[str, Any]:
    """``batchfit.find`` on the case: its max and safe batch, and its trials."""
    import batchfit

    case = args["case"]
    model, sample = build(case)
    started = time.perf_counter()
    result = batchfit.find(model, sample, memory_limit=case["limit_bytes"], amp=case["amp"], device=args["device"])
    return {
        "allocator": allocator_kind(args["device"]),
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "boundary_reached": result.boundary_reached,
        "elapsed_s": time.perf_counter() - started,
        "trials": [trial_facts(t) for t in result.trials],
        "notes": list(result.notes),
    }


def child_replay(args: dict[str, Any]) -> dict[str, Any]:
    """The replay variants at each size inside one prober, after a warm trial at ``prime`` (so
    that the warm trials meet a kept optimizer, as the search's do)."""
    import batchfit

    case = args["case"]
    model, sample = build(case)
    answer: dict[str, Any] = {"allocator": allocator_kind(args["device"]), "from_scratch_available": None, "sizes": {}}
    with batchfit.Prober(
        model, sample, memory_limit=case["limit_bytes"], amp=case["amp"], device=args["device"]
    ) as prober:
        answer["prime"] = guarded_trial(prober, args["prime"])
        for size in args["sizes"]:
            row = {"warm": guarded_trial(prober, size)}
            row["fresh_optimizer"] = guarded_trial(prober, size, fresh_optimizer=True)
            try:
                row["from_scratch"] = guarded_trial(prober, size, from_scratch=True)
                answer["from_scratch_available"] = True
            except TypeError as exc:  # a batchfit from before the replay
                if "from_scratch" not in str(exc):
                    raise
                row["from_scratch"] = None
                answer["from_scratch_available"] = False
            answer["sizes"][str(size)] = row
    return answer


def guarded_trial(prober: Any, size: int, **options: bool) -> dict[str, Any]:
    """``prober.trial(size, **options)`` as :func:`trial_facts`, or the error that is not an
    out-of-memory (a bug of the batchfit under test), so that one trial's error keeps the others."""
    try:
        return trial_facts(prober.trial(size, **options))
    except TypeError as exc:
        if "from_scratch" in str(exc):
            raise
        return {"batch": size, "fits": None, "error": first_line(exc)}
    except Exception as exc:
        return {"batch": size, "fits": None, "error": first_line(exc)}


def memory_facts(device: Any) -> dict[str, Any]:
    """The allocator's counters now (peaks since the last reset); ``{}`` off CUDA."""
    import torch

    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    facts = {
        "retries": stats.get("num_alloc_retries"),
        "allocated_peak": stats.get("allocated_bytes.all.peak"),
        "reserved_peak": stats.get("reserved_bytes.all.peak"),
        "reserved": stats.get("reserved_bytes.all.current"),
        "requested_peak": stats.get("requested_bytes.all.peak"),
        "inactive_split_peak": stats.get("inactive_split_bytes.all.peak"),
        "inactive_split": stats.get("inactive_split_bytes.all.current"),
        "segments": stats.get("segment.all.current"),
        "device_free": torch.cuda.mem_get_info(device)[0],  # the card's, all processes: the cap must come first
    }
    # cudaMallocAsync fills fewer statistics: the two peaks it does report.
    for key, read in (
        ("allocated_peak", torch.cuda.max_memory_allocated),
        ("reserved_peak", torch.cuda.max_memory_reserved),
    ):
        if facts[key] is None:
            with contextlib.suppress(RuntimeError):
                facts[key] = read(device)
    return facts


def snapshot_summary() -> dict[str, Any]:
    """``torch.cuda.memory_snapshot()`` kept small: per large segment ``[size, allocated, largest
    free block]`` (the largest :data:`SNAPSHOT_ROWS`), the rest summed."""
    import torch

    try:
        segments = torch.cuda.memory_snapshot()
    except Exception as exc:  # an allocator without snapshots (cudaMallocAsync)
        return {"error": first_line(exc)}
    rows = []
    for segment in segments:
        free = [block["size"] for block in segment.get("blocks", []) if block.get("state") == "inactive"]
        rows.append((segment["total_size"], segment["allocated_size"], max(free, default=0), sum(free)))
    rows.sort(reverse=True)
    shown, rest = rows[:SNAPSHOT_ROWS], rows[SNAPSHOT_ROWS:]
    return {
        "segments": len(rows),
        "reserved": sum(r[0] for r in rows),
        "allocated": sum(r[1] for r in rows),
        "largest_free_block": max((r[2] for r in rows), default=0),
        "split_free": sum(r[3] for r in rows if r[1] > 0),  # free, in segments that still hold a live block
        "largest": [list(r[:3]) for r in shown],
        "rest": {"segments": len(rest), "size": sum(r[0] for r in rest), "allocated": sum(r[1] for r in rest)},
    }


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and any(word in str(exc) for word in OOM_WORDS)
    )


def batches_by_length(sample: Any, size: int, lengths: list[int], device: Any) -> dict[int, Any]:
    """``size`` rows of the sample, cut to each length along dim 1 (the tokens), made once."""
    full = tile(sample, size, device)
    return {n: {key: value[:, :n].contiguous() for key, value in full.items()} for n in dict.fromkeys(lengths)}


def one_step(model: Any, optimizer: Any, batch: Mapping[str, Any], amp: Any, where: list[str]) -> None:
    """A plain training step; ``where[0]`` says its phase when an error leaves it."""
    import torch

    device_type = next(iter(batch.values())).device.type
    where[0] = "forward"
    with torch.autocast(device_type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        loss, kept = loss_of(model(**batch))
    where[0] = "backward"
    loss.backward()
    del loss, kept
    where[0] = "step"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_loop(args: dict[str, Any], answer: dict[str, Any]) -> None:
    """The plain AdamW loop under the cap, recorded into ``answer``: every ``window`` steps the
    allocator's counters (peaks since the window began when ``window`` > 1); at an out-of-memory
    its step, phase, message and, where the allocator has them, a snapshot summary."""
    import torch

    case, device = args["case"], torch.device(args["device"], 0) if args["device"] == "cuda" else torch.device("cpu")
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case["amp"] or "")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        if args.get("warm_up"):  # the probe's: cuBLAS workspaces made in segments of their own, before the cap
            from batchfit.backends.cuda import CudaBackend

            CudaBackend().warm_up(device, amp)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, case["limit_bytes"] / total), device)
    lengths = args.get("seq_lens") or [case["kwargs"]["seq_len"]]
    window, steps, long_run = args.get("window", 1), args["steps"], args.get("window", 1) > 1
    answer.update(allocator=allocator_kind(args["device"]), size=args["size"], steps_asked=steps, completed=0)
    answer.update(warm_up=bool(args.get("warm_up")), seq_lens=lengths, records=[], ooms=[], oom=None)
    where = ["setup"]
    model, sample = build(case)
    try:
        model.to(device).train()
        optimizer = torch.optim.AdamW(model.parameters())
        batches = batches_by_length(sample, args["size"], lengths, device)
    except Exception as exc:
        if not is_oom(exc):
            raise
        answer["oom"] = {"step": 0, "phase": "setup", "message": first_line(exc), **memory_facts(device)}
        return
    answer["retries_before"] = memory_facts(device).get("retries")
    started = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            if long_run and cuda and (step - 1) % window == 0:
                torch.cuda.reset_peak_memory_stats(device)  # the window's own peaks
            length = lengths[(step - 1) % len(lengths)]
            try:
                one_step(model, optimizer, batches[length], amp, where)
                answer["completed"] += 1
            except Exception as exc:
                if not is_oom(exc):
                    raise
                oom = {"step": step, "seq_len": length, "phase": where[0], "message": first_line(exc)}
                oom.update(memory_facts(device))
                if cuda:
                    if answer["allocator"] != "cudaMallocAsync":
                        oom["snapshot"] = snapshot_summary()  # the failed step's tensors still live here
                answer["ooms"].append(oom)
                answer["oom"] = answer["oom"] or oom
            if answer["oom"] is not None and (not long_run or len(answer["ooms"]) >= MAX_LONG_OOMS):
                break
            optimizer.zero_grad(set_to_none=True)
            if step % window == 0 or step == steps:
                if cuda:
                    torch.cuda.synchronize(device)
                answer["records"].append({"step": step, "seq_len": length, **memory_facts(device)})
    except KeyboardInterrupt:  # the deadline: what ran is kept
        answer["interrupted"] = True
    answer["seconds"] = time.perf_counter() - started
    answer["retries_after"] = memory_facts(device).get("retries")
    answer["final"] = memory_facts(device)


def child_fresh(args: dict[str, Any]) -> dict[str, Any]:
    """Does batch ``size`` train in this fresh process? On CUDA the plain loop under the cap; on
    CPU (no allocator cap) batchfit's own trial under its live-tensor limit, as the proof does."""
    if args["device"] != "cuda":
        return fresh_on_cpu(args)
    answer: dict[str, Any] = {"how": "plain AdamW loop under set_per_process_memory_fraction(cap / total)"}
    train_loop(args, answer)
    return answer


def fresh_on_cpu(args: dict[str, Any]) -> dict[str, Any]:
    import batchfit

    case, size, steps = args["case"], args["size"], args["steps"]
    model, sample = build(case)
    with batchfit.Prober(model, sample, memory_limit=case["limit_bytes"], amp=case["amp"], device="cpu") as prober:
        trial = prober.trial(size, steps=steps, fresh_optimizer=True)
    oom = None if trial.fits else {"step": trial.steps + 1, "phase": trial.phase, "message": trial.message}
    return {
        "how": "Prober.trial(fresh_optimizer=True) under batchfit's live-tensor limit (no CPU cap)",
        "allocator": "cpu",
        "size": size,
        "steps_asked": steps,
        "completed": trial.steps,
        "warm_up": False,
        "oom": oom,
        "ooms": [oom] if oom else [],
        "records": [],
        "retries_before": None,
        "retries_after": None,
        "peak_bytes": trial.peak_bytes,
    }


def child_long(args: dict[str, Any]) -> dict[str, Any]:
    """Many steps at one size with the sequence length cycling; on CPU uncapped (nothing to measure
    there but that the loop runs: the allocator's parts need CUDA)."""
    answer: dict[str, Any] = {"how": "plain AdamW loop, sequence lengths cycling, counters per window"}
    if args["device"] != "cuda":
        answer["how"] += " (CPU: no allocator and no cap; the loop only)"
    train_loop(args, answer)
    return answer


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "describe": child_describe,
    "find": child_find,
    "replay": child_replay,
    "fresh": child_fresh,
    "long": child_long,
}


def run_child(name: str, args_json: str) -> int:
    """The body of ``--child NAME --args JSON``: run it, print the marked answer (or the error)."""
    try:
        emit({"ok": True, **CHILDREN[name](json.loads(args_json))})
        return 0
    except KeyboardInterrupt:
        emit({"ok": False, "error": "interrupted at the deadline", "interrupted": True})
        return 1
    except Exception as exc:  # the parent records it; the traceback goes to the log
        import traceback

        traceback.print_exc()
        emit({"ok": False, "error": first_line(exc)})
        return 1


# ================================================================================================
# The plan and the parent's scheduler (no torch in this process).
# ================================================================================================
@dataclass(frozen=True)
class Plan:
    """What runs on this machine, and how many children fit at once."""

    cuda: bool
    case: dict[str, Any]
    capacity_bytes: int | None  # the card's free memory at the start (None: CPU, count children only)
    parallel: int  # children at once at most
    seq_lens: list[int]  # the long run's cycle
    timeouts: dict[str, float]  # seconds per child kind
    fresh_steps: int = 10  # a fresh child's plain steps (the proof's: >= 10)
    long_steps: int = 200
    window: int = 20  # the long run records its counters every this many steps


def plan_for(info: dict[str, Any]) -> Plan:
    """GPT-2-small under 24 GiB on CUDA (as ``benchmarks/gpu.py`` plans it); the proof's small
    GPT under 64 MiB on CPU."""
    if info["cuda"]:
        total = info["total_bytes"]
        limit = 24 * GiB if total >= 26 * GiB else int(total * 0.8) // GiB * GiB
        case = {"key": "gpt2_small", "factory": "gpt2_small", "kwargs": {"seq_len": 1024}, "amp": "bf16"}
        return Plan(
            cuda=True,
            case={**case, "limit_bytes": limit},
            capacity_bytes=info["free_bytes"],
            parallel=max(1, min(8, (info.get("cpu_count") or 2) // 2)),
            seq_lens=[1024, 960, 1024, 896],
            timeouts={"find": 180, "replay": 240, "fresh": 150, "long": 300},
        )
    gpt = {"vocab_size": 512, "seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4}
    return Plan(
        cuda=False,
        case={"key": "gpt", "factory": "gpt", "kwargs": gpt, "amp": None, "limit_bytes": 64 * MiB},
        capacity_bytes=None,
        parallel=max(1, min(2, info.get("cpu_count") or 1)),
        seq_lens=[64, 60, 64, 56],  # the GPU's 1024/960/1024/896, scaled to the sequence of 64
        timeouts={"find": 120, "replay": 120, "fresh": 90, "long": 120},
    )


#: What a job's arguments are made of once the jobs before it answered: the arguments, or why
#: it cannot run.
ArgsOf = Callable[[dict[str, dict[str, Any]]], "dict[str, Any] | str"]


@dataclass
class Job:
    """One child to start: its name in the records, the child it runs, and when it can start."""

    name: str
    child: str
    args: ArgsOf
    after: tuple[str, ...] = ()
    need_bytes: int = 0
    alloc_conf: str | None = None
    timeout_s: float = 120.0


def max_of(answers: dict[str, dict[str, Any]], name: str, key: str = "max_batch") -> int | str:
    """``answers[name][key]``, or why it is not there."""
    answer = answers.get(name) or {}
    value = answer.get(key)
    if not answer.get("ok") or not isinstance(value, int) or value < 1:
        return f"{name} gave no {key} ({answer.get('error') or value})"
    return value


def jobs_for(plan: Plan) -> tuple[list[Job], list[tuple[str, str]]]:
    """The jobs in the order they start (the most telling first), and the parts not run here."""
    case, t = plan.case, plan.timeouts
    native_need = plan.case["limit_bytes"] + CONTEXT_BYTES if plan.cuda else 0
    async_need = native_need + ASYNC_EXTRA_BYTES if plan.cuda else 0
    on_native = {"after": ("find native",), "need_bytes": native_need}
    on_async = {"after": ("find async",), "need_bytes": async_need, "alloc_conf": ASYNC}

    def around(name: str, offset: int, extra: dict[str, Any]) -> ArgsOf:
        def args(answers: dict[str, dict[str, Any]]) -> dict[str, Any] | str:
            top = max_of(answers, name)
            if isinstance(top, str):
                return top
            if top + offset < 1:
                return f"size {top + offset} is below 1"
            return {"case": case, "size": top + offset, "steps": plan.fresh_steps, **extra}

        return args

    def replay_args(answers: dict[str, dict[str, Any]]) -> dict[str, Any] | str:
        top = max_of(answers, "find native")
        if isinstance(top, str):
            return top
        sizes = [top + offset for offset in OFFSETS if top + offset >= 1]
        return {"case": case, "sizes": sizes, "prime": max(1, top // 2)}

    def long_args(answers: dict[str, dict[str, Any]]) -> dict[str, Any] | str:
        safe = max_of(answers, "find native", "safe_batch")
        if isinstance(safe, str):
            return safe
        return {"case": case, "size": safe, "steps": plan.long_steps, "window": plan.window, "seq_lens": plan.seq_lens}

    def find_args(_: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {"case": case}

    jobs = [Job("find native", "find", find_args, need_bytes=native_need, timeout_s=t["find"])]
    if plan.cuda:
        jobs.append(Job("find async", "find", find_args, need_bytes=async_need, alloc_conf=ASYNC, timeout_s=t["find"]))
    jobs.append(Job("replay", "replay", replay_args, timeout_s=t["replay"], **on_native))
    for warm in (False, True) if plan.cuda else (False,):
        for offset, label in OFFSETS.items():
            args = around("find native", offset, {"warm_up": warm})
            name = f"fresh {label}" + (" warm-up" if warm else "")
            jobs.append(Job(name, "fresh", args, timeout_s=t["fresh"], **on_native))
    jobs.append(Job("long native", "long", long_args, timeout_s=t["long"], **on_native))
    if not plan.cuda:
        cuda_only = ("find async", "fresh warm-up", "async fresh", "long expandable", "memory snapshots")
        return jobs, [(name, "no CUDA here") for name in cuda_only]
    expandable = {**on_native, "alloc_conf": EXPANDABLE}
    jobs.append(Job("long expandable", "long", long_args, timeout_s=t["long"], **expandable))
    for offset, label in OFFSETS.items():
        for copy in (1, 2):
            args = around("find async", offset, {})
            jobs.append(Job(f"async {label} #{copy}", "fresh", args, timeout_s=t["fresh"], **on_async))
    return jobs, []


def child_env(cuda: bool, alloc_conf: str | None) -> dict[str, str]:
    """Every child's environment: this source tree importable, the allocator configuration given
    and no other; on CPU no GPU visible and one thread per child (they run side by side)."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    # Children run side by side: a few threads each (CPU: one), not every core each.
    env.setdefault("OMP_NUM_THREADS", "4" if cuda else "1")
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def answer_of(output: str) -> dict[str, Any] | None:
    """A child's answer: its last line marked :data:`MARK`."""
    marked = [line for line in output.splitlines() if line.startswith(MARK)]
    return json.loads(marked[-1][len(MARK) :]) if marked else None


@dataclass
class Running:
    job: Job
    process: subprocess.Popen[bytes]
    log: Path
    started: float
    ends: float
    args: dict[str, Any]
    interrupted_at: float | None = None


@dataclass
class Scheduler:
    """Starts the jobs in order as their inputs, the card's memory and the deadline allow."""

    plan: Plan
    logs: Path
    deadline_s: float
    started: float = field(default_factory=time.monotonic)
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    not_run: list[tuple[str, str]] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():5.0f} s] {text}", flush=True)

    def run(self, jobs: list[Job]) -> None:
        pending, running = list(jobs), []
        while pending or running:
            running = [r for r in running if not self._finished(r)]
            for job in list(pending):
                args = self._ready(job, pending, running)
                if args is not None:
                    pending.remove(job)
                    running.append(self._start(job, args))
            time.sleep(0.1)

    def _ready(self, job: Job, pending: list[Job], running: list[Running]) -> dict[str, Any] | None:
        """``job``'s arguments when it starts now; a job that never can is taken off ``pending``
        with its reason."""
        skipped = {name for name, _ in self.not_run}
        gone = [name for name in job.after if name in skipped]
        if not gone and any(name not in self.answers for name in job.after):
            return None  # its inputs are still running
        args = f"{gone[0]} did not run" if gone else job.args(self.answers)
        if isinstance(args, dict) and self.elapsed() > self.deadline_s:
            args = f"deadline: it would start at {self.elapsed():.0f} s, after --deadline {self.deadline_s:.0f} s"
        if isinstance(args, str):
            pending.remove(job)
            self.not_run.append((job.name, args))
            self.say(f"not run: {job.name}: {args}")
            return None
        used = sum(r.job.need_bytes for r in running)
        capacity = self.plan.capacity_bytes
        if len(running) >= self.plan.parallel or (
            capacity is not None and running and used + job.need_bytes > capacity
        ):
            return None  # no room yet
        return args

    def _start(self, job: Job, job_args: dict[str, Any]) -> Running:
        args = {"device": "cuda" if self.plan.cuda else "cpu", **job_args}
        slug = re.sub(r"[^a-z0-9]+", "-", job.name.lower()).strip("-")
        log = self.logs / f"{slug}.log"
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", job.child, "--args", json.dumps(args)]
        with log.open("w") as sink:
            sink.write(f"# {job.name}: PYTORCH_CUDA_ALLOC_CONF={job.alloc_conf or ''} {' '.join(argv)}\n")
            sink.flush()
            process = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=child_env(self.plan.cuda, job.alloc_conf),
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        now = time.monotonic()
        ends = min(now + job.timeout_s, self.started + self.deadline_s + GRACE_S)
        self.say(f"start {job.name} ({job.child}, size {args.get('size', args.get('sizes', '-'))})")
        shown = {key: value for key, value in args.items() if key != "case"}
        return Running(job, process, log, now, ends, shown)

    def _finished(self, run: Running) -> bool:
        """Collects ``run``'s answer when it ended; stops it at its time (SIGINT, then SIGKILL)."""
        now = time.monotonic()
        if run.process.poll() is None:
            if run.interrupted_at is None and now > run.ends:
                run.interrupted_at = now
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.process.pid, signal.SIGINT)
            elif run.interrupted_at is not None and now > run.interrupted_at + INTERRUPT_GRACE_S:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.process.pid, signal.SIGKILL)
                run.process.wait()
            else:
                return False
            if run.process.poll() is None:
                return False
        output = run.log.read_text(errors="replace")
        answer = answer_of(output) or {
            "ok": False,
            "error": f"exit {run.process.returncode}, no answer: {output.strip()[-300:]}",
        }
        answer.update(
            exit_code=run.process.returncode,
            started_s=round(run.started - self.started, 1),
            seconds=round(now - run.started, 1),
            alloc_conf=run.job.alloc_conf,
            args=run.args,
            log=run.log.name,
        )
        if run.interrupted_at is not None:
            answer["cut"] = (
                f"stopped at {run.interrupted_at - self.started:.0f} s (its timeout or the deadline's grace)"
            )
        self.answers[run.job.name] = answer
        self.say(f"done {run.job.name}: {one_line(run.job.name, answer)}")
        return True


# ================================================================================================
# The verdict: pure functions of the recorded answers (tests/test_gpu_experiment.py).
# ================================================================================================
def size_text(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def fresh_fits(answer: dict[str, Any] | None) -> bool | None:
    """The rule every fresh child is judged by (issue 47 item 1): no out-of-memory in any step,
    and under the native allocator no retry during the steps. ``None``: it did not run through."""
    if not answer or not answer.get("ok"):
        return None
    if answer.get("oom"):
        return False
    if answer.get("interrupted") or answer.get("completed", 0) < answer.get("steps_asked", 0):
        return None
    before, after = answer.get("retries_before"), answer.get("retries_after")
    if answer.get("allocator") == "native" and before is not None and after is not None and after > before:
        return False
    return True


def fresh_reason(answer: dict[str, Any] | None) -> str:
    """What a fresh child did, in a few words: ``no 10 st +2 retries 23.99 GiB rsv``."""
    if not answer:
        return "not run"
    if not answer.get("ok"):
        return f"error: {answer.get('error', '?')}"[:36]
    oom = answer.get("oom")
    if oom:
        return f"OOM {oom.get('phase')} step {oom.get('step')}"
    before, after = answer.get("retries_before"), answer.get("retries_after")
    retries = f" +{after - before} retries" if before is not None and after is not None else ""
    reserved = (answer.get("final") or {}).get("reserved_peak")
    peak = f" {size_text(reserved)} rsv" if reserved is not None else ""
    word = {True: "fits", False: "no", None: "cut"}[fresh_fits(answer)]
    return f"{word} {answer.get('completed')} st{retries}{peak}"


def ran_out(trial: dict[str, Any] | None) -> bool | None:
    """Whether a trial ran out of memory (``None``: it did not run). A trial that failed only by
    the native allocator's retry rule (batchfit's ``Meter.refusal``, message "CUDA allocator
    retry: ...") ran all its steps: that is no out-of-memory."""
    if trial is None or trial.get("fits") is None:
        return None
    return not trial["fits"] and REFUSAL_WORDS not in (trial.get("message") or "")


def trial_retries(trial: dict[str, Any] | None) -> int | None:
    facts = (trial or {}).get("allocator") or {}
    return facts.get("retries")


def rule_answers(answers: dict[str, dict[str, Any]]) -> dict[str, dict[int, bool | None]]:
    """Each candidate rule's answer, by offset from its M: does the size fit? ``None``: unknown."""
    rules: dict[str, dict[int, bool | None]] = {key: dict.fromkeys(OFFSETS) for key in RULES}
    native, replay = answers.get("find native") or {}, answers.get("replay") or {}
    top = native.get("max_batch") if native.get("ok") else None
    for offset in OFFSETS:
        row = (replay.get("sizes") or {}).get(str(top + offset)) if top is not None and replay.get("ok") else None
        if row is None:
            continue
        warm, fresh, scratch = row.get("warm"), row.get("fresh_optimizer"), row.get("from_scratch")
        today = [ran_out(warm), ran_out(fresh)]  # judged as today: on out-of-memory alone
        if None not in today:
            rules["a"][offset] = not any(today)
        replayed = ran_out(scratch)
        if replayed is not None:
            rules["b"][offset] = not replayed
            rules["c"][offset] = not replayed and not trial_retries(scratch)
    async_find = answers.get("find async") or {}
    if async_find.get("ok") and isinstance(async_find.get("max_batch"), int):
        for offset in OFFSETS:
            rules["d"][offset] = offset <= 0  # the probe's answer: its max fits, max + 1 does not
    return rules


def async_truth(answers: dict[str, dict[str, Any]], label: str) -> tuple[bool | None, bool | None]:
    """``(fits, the two processes agree)`` at an async size: fits only when both did."""
    verdicts = [fresh_fits(answers.get(f"async {label} #{copy}")) for copy in (1, 2)]
    if None in verdicts:
        known = [v for v in verdicts if v is not None]
        return (known[0] if known else None), None
    return verdicts[0] and verdicts[1], verdicts[0] == verdicts[1]


def fresh_truth(answers: dict[str, dict[str, Any]]) -> dict[str, dict[int, bool | None]]:
    """What fresh processes did, by offset: native (the truth of rules a-c) and async (of d)."""
    return {
        "native": {offset: fresh_fits(answers.get(f"fresh {label}")) for offset, label in OFFSETS.items()},
        "warm-up": {offset: fresh_fits(answers.get(f"fresh {label} warm-up")) for offset, label in OFFSETS.items()},
        "async": {offset: async_truth(answers, label)[0] for offset, label in OFFSETS.items()},
    }


def compare(says: dict[int, bool | None], did: dict[int, bool | None]) -> bool | None:
    """Whether a rule's answers equal the fresh processes' at every size: ``None`` when one is unknown."""
    if any(says[o] is not None and did[o] is not None and says[o] != did[o] for o in OFFSETS):
        return False
    if any(says[o] is None or did[o] is None for o in OFFSETS):
        return None
    return True


def judge(answers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The verdict's facts: sizes, what fresh processes did, each rule's answers and agreement."""
    native, async_find = answers.get("find native") or {}, answers.get("find async") or {}
    tops = {"native": native.get("max_batch"), "async": async_find.get("max_batch")}
    truth, rules = fresh_truth(answers), rule_answers(answers)
    verdicts = {}
    for key, says in rules.items():
        did = truth["async" if key == "d" else "native"]
        verdicts[key] = {"says": says, "fresh": did, "agrees": compare(says, did)}
    agreeing = [key for key, v in verdicts.items() if v["agrees"] is True]
    differing = [key for key, v in verdicts.items() if v["agrees"] is False]
    return {"max": tops, "fresh": truth, "rules": verdicts, "agreeing": agreeing, "differing": differing}


def yes_no(value: bool | None) -> str:
    return {True: "yes", False: "no", None: "?"}[value]


def one_line(name: str, answer: dict[str, Any]) -> str:
    """A child's answer on one line, for the progress lines."""
    if not answer.get("ok"):
        return f"error: {answer.get('error')}"
    if "max_batch" in answer:
        trials = f"{len(answer['trials'])} trials, {answer['elapsed_s']:.1f} s"
        return f"max {answer['max_batch']}, safe {answer['safe_batch']} ({trials})"
    if "sizes" in answer:
        available = "available" if answer["from_scratch_available"] else "not available"
        return f"{len(answer['sizes'])} sizes, from_scratch {available}"
    return fresh_reason(answer)


def long_lines(name: str, answer: dict[str, Any] | None) -> list[str]:
    """The long run: steps, OOMs, retries, the windows' highest reserved and split-free bytes; on a
    line of its own the first OOM, with its snapshot in two numbers."""
    if not answer or not answer.get("ok"):
        return [f"  {name:<10} {'not run' if not answer else 'error: ' + str(answer.get('error'))}"]
    records, ooms = answer.get("records") or [], answer.get("ooms") or []
    parts = [f"{answer.get('completed')}/{answer.get('steps_asked')} steps, {len(ooms)} OOM(s)"]
    if answer.get("retries_after") is not None:
        parts.append(f"retries {answer.get('retries_before')}->{answer.get('retries_after')}")
    for key, text in (("reserved_peak", "reserved"), ("inactive_split_peak", "split-free")):
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            parts.append(f"{text} <= {size_text(max(values))}")
    lines = [f"  {name:<10} {', '.join(parts)}"]
    if ooms:
        first, snapshot = ooms[0], ooms[0].get("snapshot") or {}
        where = f"first OOM at step {first.get('step')}, seq {first.get('seq_len')}, {first.get('phase')}"
        if "largest_free_block" in snapshot:
            where += (
                f": {snapshot['segments']} segments, largest free block {size_text(snapshot['largest_free_block'])}, "
                f"split-free {size_text(snapshot['split_free'])}"
            )
        lines.append(f"  {'':<10} {where}")
    return lines


def async_text(answers: dict[str, dict[str, Any]], top: int | None) -> list[str]:
    """Per async size: fits (both processes), whether they agree, the requested (allocated) peaks
    and how far apart, and each pool's overhead (reserved less allocated peak)."""
    lines = []
    for offset, label in OFFSETS.items():
        pair = [answers.get(f"async {label} #{copy}") for copy in (1, 2)]
        if not any(pair):
            continue
        fits, agree = async_truth(answers, label)
        finals = [(answer or {}).get("final") or {} for answer in pair]
        requested = [final.get("allocated_peak") for final in finals]
        overheads = [
            size_text(f["reserved_peak"] - f["allocated_peak"])
            if f.get("reserved_peak") is not None and f.get("allocated_peak") is not None
            else "?"
            for f in finals
        ]
        apart = size_text(abs(requested[0] - requested[1])) if None not in requested else "?"
        size = top + offset if top is not None else label
        lines.append(
            f"  async {size}: fits {yes_no(fits)}, processes agree {yes_no(agree)}; requested peak "
            f"{size_text(requested[0])} / {size_text(requested[1])} ({apart} apart); pool +{' / +'.join(overheads)}"
        )
    return lines


def find_text(answer: dict[str, Any] | None) -> str:
    """A ``find()`` child in a few words: its max and safe batch, or why there are none."""
    if not answer:
        return "not run"
    if not answer.get("ok"):
        return f"failed: {answer.get('error')}"[:100]
    return f"max {answer.get('max_batch')}, safe {answer.get('safe_batch')}"


def header_lines(document: dict[str, Any]) -> list[str]:
    machine, plan, answers = document["machine"], document["plan"], document["answers"]
    case = plan["case"]
    where = (
        f"{machine.get('gpu')} ({size_text(machine.get('total_bytes'))}, {size_text(machine.get('free_bytes'))} free)"
        if machine.get("cuda")
        else f"CPU ({machine.get('cpu_count')} cores, no CUDA: a smoke run of the script, no measurement)"
    )
    return [
        f"batchfit experiment (issue 47 item 1: which 'fits' a fresh process keeps), {document['date']}, "
        f"{document['elapsed_s']:.0f} s, deadline {document['deadline_s']:.0f} s",
        f"machine: {where}; torch {machine.get('torch')}; at most {plan['parallel']} children at once; "
        f"batchfit from {machine.get('batchfit_from')}",
        f"case: {case['key']} {case['amp'] or 'fp32'} under {size_text(case['limit_bytes'])}; find() native (M): "
        f"{find_text(answers.get('find native'))}; under cudaMallocAsync: {find_text(answers.get('find async'))}",
    ]


def replay_cells(row: dict[str, Any]) -> str:
    """A replay row's three trials: fits, and the retries where there were some."""
    cells = []
    for key in ("warm", "fresh_optimizer", "from_scratch"):
        trial = row.get(key)
        if trial is None:
            cells.append("n/a" if key == "from_scratch" and row else "-")
        elif trial.get("fits") is None:
            cells.append("error")
        else:
            retries = trial_retries(trial)
            cells.append(yes_no(trial["fits"]) + (f" r{retries}" if retries else ""))
    return " / ".join(cells)


def size_lines(answers: dict[str, dict[str, Any]], top: int | None) -> list[str]:
    """Per size: the fresh child (the truth), the one after the warm-up, the replay's trials."""
    lines = [
        f"{'size':>8}  {'fresh process (the truth)':<36} {'fresh after warm-up':<36} replay warm/fresh-opt/scratch"
    ]
    replay = (answers.get("replay") or {}).get("sizes") or {}
    for offset, label in OFFSETS.items():
        size = top + offset if top is not None else None
        warm = answers.get(f"fresh {label} warm-up")
        lines.append(
            f"{label:>4} {size if size is not None else '?':>3}  {fresh_reason(answers.get(f'fresh {label}')):<36} "
            f"{fresh_reason(warm) if warm else '-':<36} {replay_cells(replay.get(str(size)) or {})}"
        )
    return lines


def rule_lines(verdict: dict[str, Any]) -> list[str]:
    tops = verdict["max"]
    lines = [f"{'rule':<33} {'M-1':>4} {'M':>4} {'M+1':>4}  agrees with fresh processes"]
    for key, text in SHORT_RULES.items():
        v = verdict["rules"][key]
        says = " ".join(f"{yes_no(v['says'][o]):>4}" for o in OFFSETS)
        did = "/".join(yes_no(v["fresh"][o]) for o in OFFSETS)
        against = f"async {tops['async'] or '-'}" if key == "d" else "native"
        lines.append(f"  {key} {text:<29} {says}  {yes_no(v['agrees'])} (fresh {against} M-1..M+1: {did})")
    return lines


def card_full(answers: dict[str, dict[str, Any]]) -> list[str]:
    """Children that saw the card itself nearly full (another child's memory, not the cap, may have
    refused them or made their allocator retry): the verdict cannot trust those."""
    full = []
    for name, answer in answers.items():
        seen = [*(answer.get("records") or []), *(answer.get("ooms") or []), answer.get("final") or {}]
        if any((facts or {}).get("device_free", GiB) < CARD_FULL_BYTES for facts in seen):
            full.append(name)
    return full


def render(document: dict[str, Any]) -> str:
    """The one screen printed at the end and written to ``experiment.txt``."""
    answers, verdict, plan = document["answers"], document["verdict"], document["plan"]
    lines = [*header_lines(document), "", *size_lines(answers, verdict["max"]["native"]), ""]
    lines += rule_lines(verdict)
    lines += async_text(answers, verdict["max"]["async"])
    lines.append(f"{plan['long_steps']} steps at the safe batch, sequence {'/'.join(map(str, plan['seq_lens']))}:")
    for name in ("long native", "long expandable"):
        lines += long_lines(name.split()[1], answers.get(name))
    reasons: dict[str, list[str]] = {}
    for name, why in document["not_run"]:
        reasons.setdefault(why, []).append(name)
    lines += [f"not run: {', '.join(names)}: {why}" for why, names in reasons.items()]
    full = card_full(answers)
    if full:
        lines.append(f"WARNING: the card itself was nearly full in {', '.join(full)}: rerun those alone")
    agreeing = ", ".join(f"{k} ({SHORT_RULES[k]})" for k in verdict["agreeing"]) or "none"
    differing = ", ".join(verdict["differing"]) or "none"
    smoke = (
        "" if document["machine"].get("cuda") else " (CPU: the script ran end to end; nothing about CUDA is decided)"
    )
    lines.append(f"verdict{smoke}: agrees with fresh processes at M-1..M+1: {agreeing}; disagrees: {differing}")
    return "\n".join(lines)


# ================================================================================================
# The run.
# ================================================================================================
def describe(device: str) -> dict[str, Any]:
    """The machine, from a child (this process never touches CUDA)."""
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "describe",
        "--args",
        json.dumps({"device": device}),
    ]
    try:
        done = subprocess.run(
            argv, cwd=ROOT, env=child_env(device != "cpu", None), capture_output=True, text=True, timeout=180
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "no answer in 180 s"}
    return answer_of(done.stdout) or {"ok": False, "error": (done.stdout + done.stderr).strip()[-600:]}


def deliver(out: Path, work: Path, text: str, document: dict[str, Any]) -> list[Path]:
    """The three files: the screen, every record, and the children's logs in one tarball."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "experiment.txt", out / "experiment.json", out / "experiment-logs.tar.gz"]
    written[0].write_text(text + "\n")
    written[1].write_text(json.dumps(document, indent=1, default=str))
    with tarfile.open(written[2], "w:gz") as tar:
        tar.add(work, arcname="experiment-logs")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Which 'fits' holds in a fresh process (see the module docstring).")
    parser.add_argument(
        "--out", type=Path, help="results folder (default benchmarks/results/<date>-<device>-experiment/)"
    )
    parser.add_argument("--deadline", type=float, default=520.0, help="seconds after which no child starts (520)")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu: the CPU run, on any machine")
    parser.add_argument("--render", type=Path, help="print the verdict of an experiment.json again (judged anew)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--args", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args.child, args.args)
    if args.render:
        document = json.loads(args.render.read_text())
        document["verdict"] = judge(document["answers"])
        print(render(document))
        return 0
    started = time.monotonic()
    machine = describe(args.device)
    if not machine.get("ok"):
        print(f"could not start: torch or batchfit does not start here: {machine.get('error')}", flush=True)
        return 1
    plan = plan_for(machine)
    name = re.sub(r"[^a-z0-9]+", "-", str(machine.get("gpu") or "cpu").lower()).strip("-")
    out = args.out or RESULTS / f"{time.strftime('%Y-%m-%d')}-{name}-experiment"
    jobs, skipped = jobs_for(plan)
    with tempfile.TemporaryDirectory(prefix="batchfit-experiment-") as scratch:
        work = Path(scratch)
        scheduler = Scheduler(plan, work, args.deadline, started)
        scheduler.not_run.extend(skipped)
        scheduler.run(jobs)
        document: dict[str, Any] = {
            "schema": "batchfit.gpu-experiment/1",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": machine,
            "plan": dataclasses.asdict(plan),
            "deadline_s": args.deadline,
            "elapsed_s": time.monotonic() - started,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "rules": RULES,
            "answers": scheduler.answers,
            "not_run": scheduler.not_run,
        }
        document["verdict"] = judge(scheduler.answers)
        text = render(document)
        document["text"] = text
        written = deliver(out, work, text, document)
    print("\n" + text + "\n\nwritten: " + ", ".join(str(p) for p in written), flush=True)
    crashed = [n for n, a in scheduler.answers.items() if not (a.get("ok") or a.get("interrupted") or a.get("cut"))]
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
