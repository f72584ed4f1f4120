"""The fresh processes of ``benchmarks/gpu.py``: each does one thing and prints one marked JSON line.

``python benchmarks/gpu.py --child NAME --args JSON`` runs ``CHILDREN[NAME](args)`` in a new
interpreter, so that every measurement starts from a process that never saw a CUDA context, a
cached block or an earlier out-of-memory, and so that a crash, a hang or a poisoned device there
cannot end the run: the parent reads the last line that starts with :data:`MARK` and keeps the
rest of the output as a log.

The training loop here (:func:`plain_step`) is deliberately not batchfit's: AdamW, forward, loss,
backward, step, ``zero_grad``, the way a training script writes it, so that an error batchfit's
trials share with batchfit's own checks cannot hide. The ``train`` child is the fresh process of
the rule of "batch b fits on CUDA" (issue 47): it builds the model on the GPU, empties the cache,
sets the cap ``find()`` sets, ``torch.cuda.set_per_process_memory_fraction(limit / total)``, runs
``steps`` (the proof: :data:`FRESH_STEPS`) plain steps, reads ``num_alloc_retries`` before the first
step and after each, and :func:`judge_fresh` gives its verdict per allocator:

* native: fits iff no step ran out of memory and the retries did not grow during the steps (a step
  that lived only by the allocator flushing its cache at the cap sits where history decides);
* ``expandable_segments:True``: fits iff no out-of-memory; the retries are reported, not judged;
* ``backend:cudaMallocAsync``: fits iff no out-of-memory (the fraction caps requested bytes); the
  pool's overhead (reserved peak less allocated peak) is reported.

The CPU has no allocator cap, so on CPU the ``train`` child runs batchfit's own from-scratch trial
under its live-tensor limit and says so; the same function judges it (an out-of-memory there is
batchfit's limit raising one).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: What a child prints before its JSON answer, so that library output cannot be mistaken for it.
MARK = "BATCHFIT-PROOF "
#: Words of a ``RuntimeError`` that is an out-of-memory in another library's words (this file's
#: own reading, not batchfit's classifier).
OOM_WORDS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_NOT_INITIALIZED", "CUDNN_STATUS_ALLOC")


def emit(payload: dict[str, Any]) -> None:
    print(MARK + json.dumps(payload, default=str), flush=True)


# The workload ------------------------------------------------------------------------------------
def build(case: dict[str, Any]) -> tuple[Any, Any]:
    """``(model, sample)`` of a case: a factory of ``batchfit.examples`` and its arguments."""
    from batchfit import examples

    return getattr(examples, case["factory"])(**case.get("kwargs", {}))


def tile(sample: Any, size: int, device: Any) -> Any:
    """``size`` rows made by repeating the sample's rows (a dict of tensors or one tensor)."""
    if isinstance(sample, Mapping):
        return {key: tile(value, size, device) for key, value in sample.items()}
    rows = sample.shape[0]
    repeats = [-(-size // rows)] + [1] * (sample.dim() - 1)
    return sample.repeat(*repeats)[:size].contiguous().to(device)


def loss_of(output: Any) -> tuple[Any, Any]:
    """``(loss, output to keep)``: the model's own loss with nothing kept (the output is freed
    before backward, as ``loss = model(**batch).loss`` and ``find()`` free it), else the mean of its
    (first) output with the output kept through backward (as ``criterion(model(x), y)`` keeps it)."""
    from batchfit.probe.workload import default_loss, own_loss

    own = own_loss(output)
    return (own, None) if own is not None else (default_loss(output), output)


def plain_step(model: Any, batch: Any, optimizer: Any, amp: str | None, device: Any, where: dict[str, Any]) -> None:
    """One ordinary training step; ``where["phase"]`` names the phase in progress (``forward``,
    ``backward``, ``step``), so that an out-of-memory can say where it happened."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "")
    where["phase"] = "forward"
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss, output = loss_of(model(**batch) if isinstance(batch, Mapping) else model(batch))
    where["phase"] = "backward"
    loss.backward()
    where["phase"] = "step"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del output, loss  # a plain loop holds them through the step (``criterion(model(x), y)``'s output)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_steps(model: Any, batch: Any, optimizer: Any, amp: str | None, device: Any, steps: int) -> list[float]:
    """``steps`` ordinary training steps; the wall time of each, synchronised."""
    times, where = [], {}
    for _ in range(steps):
        started = time.perf_counter()
        plain_step(model, batch, optimizer, amp, device, where)
        times.append(time.perf_counter() - started)
    return times


def set_cap(device: Any, limit_bytes: int) -> None:
    """The cap ``find()`` sets: the cache emptied, then the fraction of the runtime's total."""
    import torch

    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total), device)


def capped_device(args: dict[str, Any]) -> Any:
    """The device of the run; on CUDA with the cap set as ``find()`` sets it."""
    import torch

    if args["device"] != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    set_cap(device, args["case"]["limit_bytes"])
    return device


def memory_stats(device: Any) -> dict[str, Any]:
    """``torch.cuda.memory_stats``, or nothing where the allocator backend keeps none."""
    import torch

    try:
        return dict(torch.cuda.memory_stats(device))
    except RuntimeError:
        return {}


def cuda_peaks(device: Any) -> dict[str, Any]:
    """The allocator in use and its peaks (what it can report: ``cudaMallocAsync`` reports less)."""
    import torch

    if device.type != "cuda":
        return {}
    peaks: dict[str, Any] = {"allocator": getattr(torch.cuda, "get_allocator_backend", lambda: "native")()}
    # How often the allocator hit the cap, freed its cache and tried again: a step that trained only
    # that way sat at the edge, where the order of its allocations decides (the native allocator).
    peaks["alloc_retries"] = memory_stats(device).get("num_alloc_retries")
    reads = {"max_allocated_bytes": torch.cuda.max_memory_allocated}
    reads["max_reserved_bytes"] = torch.cuda.max_memory_reserved
    for key, read in reads.items():
        try:
            peaks[key] = read(device)
        except RuntimeError as exc:  # an allocator backend without these statistics
            peaks[key] = None
            peaks[f"{key}_error"] = first_line(exc)
    return peaks


# The rule of "batch b fits" ------------------------------------------------------------------------
#: What each allocator's fresh process is judged by (:func:`judge_fresh`).
RULES = {
    "native": "no out-of-memory in any step and no allocator retry during the steps",
    "expandable": "no out-of-memory in any step (allocator retries reported, not judged)",
    "async": "no out-of-memory in any step (the fraction caps requested bytes; the pool's overhead reported)",
    "cpu": "batchfit's from-scratch trial under its live-tensor limit (the CPU has no allocator cap)",
}
#: The proof's fresh processes run this many steps (the rule: at least 10).
FRESH_STEPS = 10
#: An out-of-memory with less than this free on the whole device was the device running full (the
#: proof's other processes), not the cap: the answer says nothing about the cap.
DEVICE_FULL_BYTES = 2**30


def allocator_kind(backend: str | None, conf: str | None) -> str:
    """``native``, ``expandable`` or ``async``: the allocator a CUDA process runs, from
    ``torch.cuda.get_allocator_backend()`` and ``PYTORCH_CUDA_ALLOC_CONF`` (the backend alone
    does not tell expandable segments from the native allocator)."""
    if backend == "cudaMallocAsync" or "cudamallocasync" in (conf or "").replace(" ", "").lower():
        return "async"
    settings = dict(part.split(":", 1) for part in (conf or "").replace(" ", "").split(",") if ":" in part)
    return "expandable" if settings.get("expandable_segments", "").lower() == "true" else "native"


def judge_fresh(facts: Mapping[str, Any]) -> dict[str, Any]:
    """The verdict of a fresh process on its recorded ``facts`` (what :func:`train` records:
    ``allocator`` (``native``/``expandable``/``async``/``cpu``), ``steps_wanted``, ``steps`` run,
    ``oom`` (``None`` or its ``step``, ``phase`` and ``message``), ``retries_before`` and
    ``per_step`` (``retries`` so far, ``max_allocated_bytes``, ``max_reserved_bytes``), and on an
    out-of-memory ``device_free_bytes``): ``fits``, the ``rule`` applied, ``why`` in words, the
    ``retries`` during the steps, the async pool's ``pool_overhead_bytes``, and ``void`` when the
    answer says nothing about the cap (the whole device was full)."""
    kind = facts.get("allocator") or "native"
    steps, wanted = facts.get("steps") or 0, facts.get("steps_wanted") or 0
    per_step = list(facts.get("per_step") or [])
    before = facts.get("retries_before")
    counts = [s.get("retries") for s in per_step]
    retries = None
    if before is not None and counts and counts[-1] is not None:
        retries = counts[-1] - before
    grew = [s["step"] for s, c, p in zip(per_step, counts, [before, *counts]) if None not in (c, p) and c > p]
    last = per_step[-1] if per_step else {}
    peak_reserved = facts.get("max_reserved_bytes", last.get("max_reserved_bytes"))
    peak_allocated = facts.get("max_allocated_bytes", last.get("max_allocated_bytes"))
    overhead = None
    if kind == "async" and peak_reserved is not None and peak_allocated is not None:
        overhead = peak_reserved - peak_allocated
    verdict: dict[str, Any] = {"rule": RULES.get(kind, RULES["native"]), "retries": retries, "void": False}
    verdict["pool_overhead_bytes"] = overhead
    oom = facts.get("oom")
    if oom:
        where = f" of step {oom['step']}" if oom.get("step") else ""
        why = f"OOM in the {oom.get('phase') or '?'}{where}: {oom.get('message') or ''}".rstrip(": ")
        free = facts.get("device_free_bytes")
        if free is not None and free < DEVICE_FULL_BYTES:
            why += f" (VOID: {free / 2**30:.2f} GiB free on the whole device: it ran full, not the cap)"
            verdict["void"] = True
        return {**verdict, "fits": False, "why": why}
    if steps < wanted:
        return {**verdict, "fits": False, "why": f"ran {steps} of {wanted} steps"}
    shown = f"{steps} steps" + (f", reserved peak {peak_reserved / 2**30:.2f} GiB" if peak_reserved else "")
    if kind == "native" and retries:
        steps_text = ", ".join(str(s) for s in grew)
        why = f"trains only by flushing the cache at the cap: {retries} allocator retries (step {steps_text}); {shown}"
        return {**verdict, "fits": False, "why": why}
    if kind == "expandable" and retries:
        shown += f", {retries} allocator retries (not judged)"
    if overhead is not None:
        shown += f", pool overhead {overhead / 2**30:.2f} GiB"
    return {**verdict, "fits": True, "why": f"trains ({shown})"}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


# The children ------------------------------------------------------------------------------------
def describe(args: dict[str, Any]) -> dict[str, Any]:
    """What torch sees, for the preflight: versions, the GPU and its free memory, the driver, a C
    compiler for Triton."""
    import shutil

    import torch

    import batchfit

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "batchfit": batchfit.__version__,
        "batchfit_from": str(Path(batchfit.__file__).resolve().parent),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available() and args.get("device") != "cpu",
        # Triton compiles its launchers with the system's C compiler: torch.compile needs one.
        "cc": shutil.which("cc") or shutil.which("gcc"),
        "modules": {name: _version_of(name) for name in ("pytest", "pynvml", "matplotlib", "transformers", "ray")},
    }
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor() or platform.machine()
    if info["cuda"]:
        from batchfit.backends import query_devices

        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_total_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
            gpu_count=torch.cuda.device_count(),
            driver=query_devices().driver_version,
        )
        # What the proof's children may share (its lanes): free now, this process's context
        # included, so a little less than they will find.
        info["gpu_free_bytes"] = torch.cuda.mem_get_info(0)[0]
    return info


def _version_of(module: str) -> str | None:
    """The installed version of ``module``'s distribution, ``None`` when it is not importable."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return None
    distribution = {"pynvml": "nvidia-ml-py"}.get(module, module)
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "present"


def fraction(args: dict[str, Any]) -> dict[str, Any]:
    """What ``get_per_process_memory_fraction`` reads before any fraction is set, under the
    allocator this process was started with (``backend:cudaMallocAsync`` reads the unset limit
    over total memory, about 2e8: pytorch#110194, which batchfit must never write back)."""
    import torch

    if args["device"] == "cpu" or not torch.cuda.is_available():
        return {"allocator": None, "fraction": None}
    torch.cuda.init()
    backend = getattr(torch.cuda, "get_allocator_backend", lambda: "native")()
    return {"allocator": backend, "fraction": torch.cuda.get_per_process_memory_fraction(0)}


def find(args: dict[str, Any]) -> dict[str, Any]:
    """``batchfit.find`` on the case under its limit; the result's JSON goes to ``args["out"]``."""
    import batchfit

    case = args["case"]
    model, sample = build(case)
    result = batchfit.find(model, sample, memory_limit=case["limit_bytes"], amp=case["amp"], device=args["device"])
    Path(args["out"]).write_text(result.to_json())
    import torch

    device = torch.device(args["device"], 0) if args["device"] == "cuda" else torch.device("cpu")
    return {
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "safe_verified": result.safe_verified,
        "boundary_reached": result.boundary_reached,
        "stop_reason": result.stop_reason,
        "budget_bytes": result.budget_bytes,
        "trials": len(result.trials),
        "elapsed_s": result.elapsed_s,
        "notes": list(result.notes),
        "device_config": dict(result.device.config),
        **cuda_peaks(device),
    }


def train(args: dict[str, Any]) -> dict[str, Any]:
    """Does batch ``args["size"]`` train ``args["steps"]`` steps (default :data:`FRESH_STEPS`) from
    scratch under the cap, in this fresh process? Its facts and :func:`judge_fresh`'s verdict on
    them (``fits``)."""
    case, size = args["case"], int(args["size"])
    steps = int(args.get("steps") or FRESH_STEPS)
    facts = train_cuda(case, size, steps) if args["device"] == "cuda" else train_cpu(case, size, steps)
    return {**facts, **judge_fresh(facts)}


def train_cpu(case: dict[str, Any], size: int, steps: int) -> dict[str, Any]:
    """On CPU: batchfit's from-scratch trial under its live-tensor limit (the CPU has no cap)."""
    import inspect

    import batchfit

    model, sample = build(case)
    with batchfit.Prober(model, sample, memory_limit=case["limit_bytes"], amp=case["amp"], device="cpu") as prober:
        # Prober.trial(from_scratch=True) where this batchfit has it (issue 47), else a fresh optimizer.
        scratch = "from_scratch" if "from_scratch" in inspect.signature(prober.trial).parameters else "fresh_optimizer"
        trial = prober.trial(size, steps=steps, kind="verify", **{scratch: True})
    oom = None if trial.fits else {"step": None, "phase": getattr(trial, "phase", None), "message": trial.message}
    return {
        "how": f"Prober.trial(kind='verify', {scratch}=True) under batchfit's live-tensor limit (no CPU cap)",
        "allocator": "cpu",
        "size": size,
        "steps_wanted": steps,
        "steps": trial.steps if trial.fits else 0,
        "oom": oom,
        "peak_bytes": trial.peak_bytes,
        "message": trial.message,
    }


def train_cuda(case: dict[str, Any], size: int, steps: int) -> dict[str, Any]:
    """On CUDA: the model built on the GPU, the cache emptied, the cap set, then plain AdamW steps,
    with the allocator's retries, peaks and split-free peak read before the first step and after
    each, and an out-of-memory's step, phase and first line."""
    import torch

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    backend = getattr(torch.cuda, "get_allocator_backend", lambda: "native")()
    facts: dict[str, Any] = {
        "how": "plain AdamW loop in a fresh process: model on the GPU, empty_cache, "
        "set_per_process_memory_fraction(limit / total), then the steps",
        "allocator": allocator_kind(backend, conf),
        "alloc_conf": conf,
        "size": size,
        "steps_wanted": steps,
        "steps": 0,
        "oom": None,
    }
    per_step: list[dict[str, Any]] = []
    where: dict[str, Any] = {"phase": "setup"}
    step = 0
    try:
        model, sample = build(case)
        model.to(device).train()
        set_cap(device, case["limit_bytes"])
        optimizer = torch.optim.AdamW(model.parameters())
        where["phase"] = "batch"
        batch = tile(sample, size, device)
        facts["retries_before"] = memory_stats(device).get("num_alloc_retries")
        for step in range(1, steps + 1):
            started = time.perf_counter()
            plain_step(model, batch, optimizer, case["amp"], device, where)
            stats = memory_stats(device)
            per_step.append(
                {
                    "step": step,
                    "seconds": time.perf_counter() - started,
                    "retries": stats.get("num_alloc_retries"),
                    "max_allocated_bytes": torch.cuda.max_memory_allocated(device),
                    "max_reserved_bytes": torch.cuda.max_memory_reserved(device),
                    "inactive_split_peak_bytes": stats.get("inactive_split_bytes.all.peak"),
                }
            )
            facts["steps"] = step
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        # cuBLAS/cuDNN failing to get their workspace is an out-of-memory too
        if not isinstance(exc, torch.OutOfMemoryError) and not any(word in str(exc) for word in OOM_WORDS):
            raise
        facts["oom"] = {"step": step or None, "phase": where["phase"], "message": first_line(exc)}
        facts["retries_at_oom"] = memory_stats(device).get("num_alloc_retries")
        facts["reserved_at_oom_bytes"] = torch.cuda.memory_reserved(device)
        facts["device_free_bytes"] = torch.cuda.mem_get_info(device)[0]
    facts["per_step"] = per_step
    facts["step_times_s"] = [s["seconds"] for s in per_step]
    facts["inactive_split_peak_bytes"] = memory_stats(device).get("inactive_split_bytes.all.peak")
    peaks = cuda_peaks(device)
    peaks["backend"] = peaks.pop("allocator")  # "allocator" is the kind judged (expandable is "native" here)
    return {**facts, **peaks}


def estimate(args: dict[str, Any]) -> dict[str, Any]:
    """``batchfit.estimate`` for the case's limit, nothing kept aside (``find``'s budget is the limit)."""
    import batchfit

    case = args["case"]
    model, sample = build(case)
    started = time.perf_counter()
    result = batchfit.estimate(
        model, sample, memory_limit=case["limit_bytes"], device=args["device"], amp=case["amp"], reserve=0
    )
    Path(args["out"]).write_text(result.to_json())
    return {
        "max_batch": result.max_batch,
        "safe_batch": result.safe_batch,
        "trials": len(result.trials),
        "elapsed_s": time.perf_counter() - started,
        "assumptions": list(result.assumptions),
    }


def throughput(args: dict[str, Any]) -> dict[str, Any]:
    """Steady-state samples/s of plain steps at each size: warm-up steps, then timed ones (median)."""
    import torch

    case = args["case"]
    device = capped_device(args)
    model, sample = build(case)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters())
    rates: dict[str, Any] = {}
    for size in args["sizes"]:
        try:
            batch = tile(sample, size, device)
            plain_steps(model, batch, optimizer, case["amp"], device, args["warmup"])
            times = plain_steps(model, batch, optimizer, case["amp"], device, args["timed"])
            median = statistics.median(times)
            rates[str(size)] = {"samples_per_s": size / median, "step_time_s": median, "step_times_s": times}
        except torch.OutOfMemoryError as exc:
            rates[str(size)] = {"samples_per_s": None, "message": first_line(exc)}
            optimizer.zero_grad(set_to_none=True)
        batch = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # each size starts without the cached blocks of the one before
    return {"rates": rates, "threads": torch.get_num_threads(), **cuda_peaks(device)}


def frontier(args: dict[str, Any]) -> dict[str, Any]:
    """``batchfit.frontier`` on the case's model at ``args["seq_lens"]`` under its limit; the
    frontier's JSON goes to ``args["out"]`` and its picture to ``args["plot"]`` (when matplotlib is there)."""
    import torch

    import batchfit

    case = args["case"]
    model, _ = build(case)
    vocab = model.token.num_embeddings  # batchfit.examples.GPT

    def make_batch(batch_size: int, seq_len: int) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
        return {"input_ids": ids, "labels": ids}

    result = batchfit.frontier(
        model,
        make_batch,
        seq_lens=args["seq_lens"],
        memory_limit=case["limit_bytes"],
        amp=case["amp"],
        device=args["device"],
    )
    Path(args["out"]).write_text(result.to_json())
    try:
        result.plot(args["plot"])
        plotted = True
    except ImportError:
        plotted = False
    return {
        "points": [
            {
                "seq_len": p.seq_len,
                "max_batch": p.max_batch,
                "safe_batch": p.safe_batch,
                "boundary_reached": p.result.boundary_reached,
                "safe_verified": p.result.safe_verified,
                "tokens_per_s": p.tokens_per_s,
                "trials": p.trials,
            }
            for p in result.points
        ],
        "longest_at_batch_1": result.longest_at_batch_1,
        "longest_limited_by": result.longest_limited_by,
        "token_budget": result.token_budget,
        "surface": None if result.surface is None else result.surface.meaning(),
        "trials": result.trials,
        "elapsed_s": result.elapsed_s,
        "plotted": plotted,
        "text": str(result),
    }


#: The gate's model (``batchfit probe`` loads it as ``benchmarks/proof_children.py:gate_cuda``):
#: about 250 MB of activations per sample, far above the allocator's 2 MiB segment rounding, so
#: that batch max + 1 cannot fit in the rounding slack of batch max.
GATE_CUDA = {"vocab_size": 8192, "seq_len": 512, "d_model": 512, "n_layers": 4, "n_heads": 8}
#: The same on CPU, small enough for CI (the live-tensor limit counts bytes, no rounding).
GATE_CPU = {"vocab_size": 512, "seq_len": 64, "d_model": 128, "n_layers": 2, "n_heads": 4}


def gate_cuda() -> tuple[Any, Any]:
    """The gate's target on a GPU (see :data:`GATE_CUDA`)."""
    return build({"factory": "gpt", "kwargs": GATE_CUDA})


def gate_cpu() -> tuple[Any, Any]:
    """The gate's target on CPU (see :data:`GATE_CPU`)."""
    return build({"factory": "gpt", "kwargs": GATE_CPU})


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "describe": describe,
    "fraction": fraction,
    "find": find,
    "train": train,
    "estimate": estimate,
    "throughput": throughput,
    "frontier": frontier,
}


def run_child(name: str, args_json: str) -> None:
    """The body of ``--child NAME --args JSON``: run it, print the marked answer (or the error)."""
    try:
        emit({"ok": True, **CHILDREN[name](json.loads(args_json))})
    except Exception as exc:  # the parent records it; the traceback goes to the log
        import traceback

        traceback.print_exc()
        emit({"ok": False, "error": first_line(exc)})
        raise SystemExit(1) from None
