"""batchfit against PyTorch Lightning and Accelerate, side by side, on the same model and memory cap.

Run from the repository root (Lightning and Accelerate are optional; a finder whose package is
missing gets a row that says so)::

    python benchmarks/compare.py                               # the six CPU cases
    python benchmarks/compare.py --case cnn --cap 2MB --steps 1  # one small case
    python benchmarks/gpu_compare.py                           # the CUDA comparison

For every case (a built-in example model and a memory cap) the finders run one after another
in this process, each on a freshly built (seeded, identical) model:

* **exhaustive scan**: batchfit ``Prober`` trials at 1, 2, 3, ... until the first failure. Its
  last fitting size is the truth every other row is measured against.
* **batchfit** ``find()`` with each search strategy (``binary`` and ``interpolate``).
* **Lightning** ``Tuner.scale_batch_size`` in ``power`` and ``binsearch`` modes, with its
  defaults and with ``margin=0`` and a ``max_val`` above the truth.
* **Accelerate** ``find_executable_batch_size`` started at 2x and 8x the truth.

On CPU the cap is batchfit's live-tensor limit: a ``TorchDispatchMode`` that raises a real
``torch.OutOfMemoryError`` (with the CPU allocator's wording) at the operation that takes live
tensor memory over the cap. Lightning and Accelerate run their own loops under the same meter:
it is active while they build batches (collate) and run training steps (forward, backward,
optimizer step). Their code is not changed; the script only counts their trials and OOMs with
hooks. On CUDA the cap is the CUDA allocator's per-process memory fraction, active for the
whole case.

Benchmarks are not tests: nothing here asserts a timing. Output: a table on stdout and a JSON
file under ``benchmarks/results/`` (date, machine, versions, every row, the throughput of every
size batchfit tried and the knee).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import importlib.util
import json
import logging
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import batchfit
from batchfit import examples
from batchfit import search as search_mod
from batchfit.backends import LiveTensorMeter, Meter
from batchfit.probe import Options
from batchfit.probe.batches import batch_size_of, tile
from batchfit.probe.workload import call_model, default_loss, own_loss
from batchfit.search.interpolate import Interpolating
from batchfit.units import format_bytes, parse_memory_limit

RESULTS = Path(__file__).resolve().parent / "results"
STRATEGIES = ("binary", "interpolate")
KNEE_FRACTION = 0.95


# Cases -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """A built-in example model under one memory cap."""

    model: str
    cap_bytes: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    amp: str | None = None

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.kwargs.items())
        amp = f" {self.amp}" if self.amp else ""
        return f"{self.model}{'(' + extra + ')' if extra else ''}{amp} @ {format_bytes(self.cap_bytes)}"

    def build(self) -> tuple[torch.nn.Module, Any]:
        """A fresh model and sample: the factories are seeded, so every finder gets the same model."""
        return getattr(examples, self.model)(**self.kwargs)


#: CPU caps (live tensor bytes) put the truth between about 40 and 100, so that the exhaustive
#: scan stays short on two cores. The MLP's peak is its optimizer step up to ~380 samples (the
#: flat-then-linear case of DESIGN.md): its boundary is decided by the batch bytes that stay
#: live during the step, while its forward line grows 12x faster and crosses later.
CPU_CASES: tuple[Case, ...] = (
    Case("mlp", 12_740_000),
    Case("mlp", 12_800_000),
    Case("cnn", 13_200_000),
    Case("cnn", 32_800_000),
    Case("gpt", 72_000_000),
    Case("gpt", 100_000_000),
)


# Rows --------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One finder's outcome on one case."""

    finder: str
    setting: str
    found: int | None = None
    trials: int | None = None
    ooms: int | None = None
    wall_s: float | None = None
    sizes: list[int] = field(default_factory=list)
    fits: list[bool] = field(default_factory=list)
    #: Steps each trial completed (peers: counted by hooks; a failed trial's last one died).
    completed: list[int] = field(default_factory=list)
    note: str = ""
    skipped: str | None = None
    delta: int | None = None
    ratio: float | None = None


class Tally:
    """Trials as a peer ran them: the size of each and whether all its steps completed.

    Peers are only observed (a hook or the user function records a trial's start and each
    completed step); nothing they decide is changed.
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.sizes: list[int] = []
        self.completed: list[int] = []

    def start(self, batch_size: int) -> None:
        self.sizes.append(int(batch_size))
        self.completed.append(0)

    def step_done(self) -> None:
        if self.completed:
            self.completed[-1] += 1

    def fill(self, row: Row) -> Row:
        row.sizes = list(self.sizes)
        row.fits = [done >= self.steps for done in self.completed]
        row.completed = list(self.completed)
        row.trials = len(self.sizes)
        row.ooms = row.fits.count(False)
        return row


# Memory cap helpers ---------------------------------------------------------------------------------
def cap_during(meter: Meter | None) -> contextlib.AbstractContextManager[Any]:
    """The cap for a peer's work: the live-tensor meter's tracking on CPU (CUDA's cap is the
    allocator fraction, already active for the whole Prober)."""
    if isinstance(meter, LiveTensorMeter):
        return meter.tracking()
    return contextlib.nullcontext()


def release(device: torch.device) -> None:
    """Between finders: collect garbage and, on CUDA, give cached blocks back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def capped(case: Case, device: torch.device, steps: int) -> Iterator[tuple[torch.nn.Module, Any, batchfit.Prober]]:
    """A fresh model inside a batchfit Prober with the case's cap: the same meter, limit and
    model placement batchfit's own trials get; model state is restored on exit."""
    model, sample = case.build()
    prober = batchfit.Prober(
        model, sample, memory_limit=case.cap_bytes, device=device, steps_per_trial=steps, amp=case.amp
    )
    with prober:
        yield model, sample, prober
    release(device)


# Finders: truth and batchfit ----------------------------------------------------------------------
def exhaustive(case: Case, device: torch.device, steps: int, limit: int) -> tuple[Row, list[tuple[int, float | None]]]:
    """Trials at 1, 2, 3, ... until the first failure: the truth, and samples/s at every size."""
    row = Row("exhaustive scan", f"b=1.. until OOM, {steps} steps")
    speeds: list[tuple[int, float | None]] = []
    started = time.perf_counter()
    with capped(case, device, steps) as (_, _, prober):
        size = 1
        while size <= limit:
            trial = prober.trial(size)
            row.sizes.append(size)
            row.fits.append(trial.fits)
            if not trial.fits:
                break
            speeds.append((size, trial.samples_per_s))
            size += 1
    row.wall_s = time.perf_counter() - started
    row.trials, row.ooms = len(row.sizes), row.fits.count(False)
    row.found = max((s for s, f in zip(row.sizes, row.fits) if f), default=None)
    if row.fits and row.fits[-1]:
        row.note = f"stopped at the scan limit {limit} without an OOM"
    return row, speeds


def find_forwards_budget(device: torch.device) -> bool:
    """Whether ``batchfit.find`` hands the memory budget to the search strategy.

    The interpolating strategy aims at the budget; without it, it proposes what the plain one
    does. A tiny probe with a spy strategy tells, without reading find()'s source.
    """
    seen: list[int | None] = []

    class Spy(search_mod.Doubling):
        def propose(self, bracket: search_mod.Bracket) -> int:
            seen.append(bracket.budget_bytes)
            return super().propose(bracket)

    model, sample = examples.mlp(in_features=8, hidden=8, depth=1, classes=2)
    batchfit.find(
        model,
        sample,
        memory_limit="64MB",
        device=device,
        max_batch=4,
        steps_per_trial=1,
        verify_steps=0,
        strategy=Spy(),
    )
    return any(value is not None for value in seen)


def run_batchfit(
    case: Case, device: torch.device, steps: int, strategy: str, forwards_budget: bool
) -> tuple[Row, batchfit.Result]:
    """``batchfit.find`` as a user calls it (defaults, so a verification trial at the safe batch)."""
    model, sample = case.build()
    chooser: str | search_mod.Strategy = strategy
    note = ""
    if strategy == "interpolate" and not forwards_budget:
        # The same budget find() would hand the strategy on this device: the cap.
        chooser = Interpolating(budget_bytes=case.cap_bytes)
        note = "budget passed to the strategy by this script (find() does not forward it yet); "
    started = time.perf_counter()
    result = batchfit.find(
        model, sample, memory_limit=case.cap_bytes, device=device, amp=case.amp, steps_per_trial=steps, strategy=chooser
    )
    wall = time.perf_counter() - started
    release(device)
    search = result.search_trials
    verify = [t for t in result.trials if t.kind == "verify"]
    row = Row(
        "batchfit",
        strategy,
        found=result.max_batch,
        trials=len(search),
        ooms=sum(not t.fits for t in search),
        wall_s=wall,
        sizes=[t.batch_size for t in search],
        fits=[t.fits for t in search],
    )
    verified = f"+{len(verify)} verify trial(s), " if verify else ""
    row.note = f"{note}{verified}safe batch {result.safe_batch}"
    if not result.boundary_reached:
        row.note += f"; boundary not reached ({result.stop_reason})"
    return row, result


# Finders: Lightning -------------------------------------------------------------------------------
def lightning_available() -> bool:
    return importlib.util.find_spec("lightning") is not None


def quiet_lightning() -> None:
    """Lightning logs every trial and warns about dataloader workers; the table says what matters."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"lightning(\..*)?")
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")


class RepeatedRows(torch.utils.data.Dataset):
    """The sample's rows, repeated: a dataset far longer than any batch (Lightning stops scaling
    at the dataset's length)."""

    def __init__(self, sample: Any, length: int = 10**8) -> None:
        self.sample = sample
        self.rows = batch_size_of(sample)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        row = index % self.rows
        if isinstance(self.sample, dict):
            return {key: value[row] for key, value in self.sample.items()}
        if isinstance(self.sample, (tuple, list)):
            return type(self.sample)(value[row] for value in self.sample)
        return self.sample[row]


def lightning_module(model: torch.nn.Module, sample: Any, meter: Meter | None, tally: Tally) -> Any:
    """A LightningModule around the example model with batchfit's default loss and AdamW.

    The cap is active while the DataLoader collates a batch and inside ``optimizer_step``
    (which runs training_step, backward and the optimizer step in Lightning's closure). Lightning's
    bookkeeping between trials runs outside it: under the live-tensor meter, its OOM handler's
    own small allocations (while the failed step's tensors are still referenced by the
    exception) would fail again and end the run.
    """
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, default_collate

    def collate(items: list[Any]) -> Any:
        with cap_during(meter):
            return default_collate(items)

    class Wrapped(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.batch_size = 2

        def train_dataloader(self) -> DataLoader:
            return DataLoader(RepeatedRows(sample), batch_size=self.batch_size, collate_fn=collate)

        def on_train_start(self) -> None:
            tally.start(self.batch_size)

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            tally.step_done()

        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            # The loop batchfit's trial stands for, so all run the same workload: the model's own
            # loss alone (its output freed before backward, as `loss = model(**batch).loss`),
            # else the output returned with the loss (ordinary Lightning: on_train_batch_end gets
            # it), alive through backward and the optimizer step.
            output = call_model(self.model, batch)
            own = own_loss(output)
            return {"loss": own} if own is not None else {"loss": default_loss(output), "output": output}

        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            with cap_during(meter):
                super().optimizer_step(*args, **kwargs)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters())

    return Wrapped()


def run_lightning(
    case: Case, device: torch.device, steps: int, mode: str, margin: float | None, max_val: int | None
) -> Row:
    """``Tuner(trainer).scale_batch_size`` with Lightning's own fit loop, as its docs show."""
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    quiet_lightning()
    options: dict[str, Any] = {"mode": mode, "steps_per_trial": steps}
    if margin is not None:
        options["margin"] = margin
    if max_val is not None:
        options["max_val"] = max_val
    setting = mode + ("" if margin is None and max_val is None else f", margin={margin}, max_val={max_val}")
    row = Row("Lightning", setting)
    tally = Tally(steps)
    precision = {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(case.amp or "", "32-true")
    with tempfile.TemporaryDirectory() as root, capped(case, device, steps) as (model, sample, prober):
        started = time.perf_counter()
        trainer = pl.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=1,
            max_epochs=1,
            precision=precision,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=root,
        )
        try:
            row.found = Tuner(trainer).scale_batch_size(lightning_module(model, sample, prober.meter, tally), **options)
        except Exception as exc:  # report what happened; the table says why the row is empty
            row.note = "; ".join(filter(None, [row.note, raised(exc)]))
        row.wall_s = time.perf_counter() - started
    return tally.fill(row)


# Finders: Accelerate ------------------------------------------------------------------------------
def accelerate_available() -> bool:
    return importlib.util.find_spec("accelerate") is not None


def run_accelerate(case: Case, device: torch.device, steps: int, start: int, start_label: str) -> Row:
    """``find_executable_batch_size`` around a training function with the same steps as a trial.

    The function is what a user writes, and what batchfit's trial runs: fresh AdamW, ``steps``
    steps on a batch of the given size (the model's output stays referenced until the optimizer
    step is done, as in ``outputs = model(batch); loss = outputs.loss; ...; optimizer.step()``),
    under autocast if the case asks for it. Accelerate shrinks by 10% after each OOM.
    """
    from accelerate.utils import find_executable_batch_size

    row = Row("Accelerate", f"start {start_label}", note=f"starting_batch_size={start}")
    tally = Tally(steps)
    with capped(case, device, steps) as (model, sample, prober):
        on_device = _to(sample, device)
        rows = batch_size_of(sample)
        autocast = _autocast(case, device)

        def train(batch_size: int) -> int:
            tally.start(batch_size)
            model.zero_grad(set_to_none=True)
            with cap_during(prober.meter):
                batch = tile(on_device, batch_size, rows)
                optimizer = torch.optim.AdamW(model.parameters())
                for _ in range(steps):
                    with autocast():
                        output = call_model(model, batch)
                        loss = own_loss(output)
                        if loss is None:  # the output is alive through the step, as in batchfit's trial
                            loss = default_loss(output)
                        else:
                            output = None  # freed before backward, as batchfit's trial frees it
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    del output, loss
                    tally.step_done()
            return batch_size

        started = time.perf_counter()
        try:
            row.found = find_executable_batch_size(train, starting_batch_size=start)()
        except Exception as exc:
            row.note = "; ".join(filter(None, [row.note, raised(exc)]))
        row.wall_s = time.perf_counter() - started
    return tally.fill(row)


def raised(exc: BaseException) -> str:
    """A peer's exception as one line for the table; its traceback (and the tensors its frames
    hold) is dropped so the next finder starts from released memory."""
    exc.__traceback__ = None
    return f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def _to(sample: Any, device: torch.device) -> Any:
    from batchfit.probe.batches import to_device

    return to_device(sample, device)


def _autocast(case: Case, device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case.amp or "")
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


# Do the peers recognise the cap's OOM? ---------------------------------------------------------------
def oom_recognition(device: torch.device) -> dict[str, Any]:
    """Raise the cap's out-of-memory in a forward and in a backward, and ask each peer's own
    classifier whether it is an OOM. A peer that says no would not shrink: the output says so."""
    errors = {"forward": _cap_oom(device, in_backward=False), "backward": _cap_oom(device, in_backward=True)}
    report: dict[str, Any] = {where: f"{type(e).__name__}: {str(e)[:160]}" for where, e in errors.items()}
    if lightning_available():
        from lightning.pytorch.utilities.memory import is_oom_error

        report["lightning"] = {where: bool(is_oom_error(e)) for where, e in errors.items()}
    if accelerate_available():
        from accelerate.utils.memory import should_reduce_batch_size

        report["accelerate"] = {where: bool(should_reduce_batch_size(e)) for where, e in errors.items()}
    for error in errors.values():
        error.__traceback__ = None
    return report


def _cap_oom(device: torch.device, in_backward: bool) -> BaseException:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        try:
            torch.empty(2 * total, dtype=torch.uint8, device=device)
        except Exception as exc:  # a real CUDA OOM (backward placement makes no difference here)
            return exc
        raise RuntimeError("allocating twice the GPU's memory did not fail")
    weight = torch.randn(256, 256, requires_grad=True)
    meter = LiveTensorMeter(budget_bytes=None, total_bytes=None, baseline_bytes=0)
    try:
        with meter.tracking():
            if in_backward:
                loss = (torch.randn(64, 256) @ weight).relu().sum()
                meter.budget_bytes = meter.allocated_bytes()  # the next new tensor goes over
                loss.backward()
            else:
                meter.budget_bytes = 1024
                torch.empty(1 << 20)
    except Exception as exc:
        return exc
    raise RuntimeError("the live-tensor meter did not raise")


# Throughput ----------------------------------------------------------------------------------------
def knee(points: list[tuple[int, float | None]]) -> dict[str, Any] | None:
    """The smallest size whose samples/s reach 95% of the best measured: past it, bigger
    batches stop paying in throughput."""
    timed = [(size, rate) for size, rate in points if rate]
    if not timed:
        return None
    best_size, best = max(timed, key=lambda p: p[1])
    first = min(size for size, rate in timed if rate >= KNEE_FRACTION * best)
    return {"knee": first, "best_batch": best_size, "best_samples_per_s": best}


def tried_speeds(result: batchfit.Result) -> list[tuple[int, float | None]]:
    return sorted((t.batch_size, t.samples_per_s) for t in result.search_trials if t.fits)


# One case ----------------------------------------------------------------------------------------------
def run_case(
    case: Case,
    device: torch.device,
    steps: int,
    finders: set[str],
    forwards_budget: bool,
    scan_limit: int,
    reference: str | None = None,
) -> dict[str, Any]:
    print(f"\n== {case.label} ==", flush=True)
    load_at_start = _load()
    cpu_at_start = _cpu_snapshot()
    truth_row, scan_speeds = exhaustive(case, device, steps, scan_limit)
    truth = truth_row.found
    rows = [truth_row]
    print(f"   truth {truth} ({truth_row.trials} trials, {truth_row.wall_s:.1f} s)", flush=True)
    if truth is None:
        raise SystemExit(f"{case.label}: even batch 1 does not fit under the cap; raise the cap")
    results: dict[str, batchfit.Result] = {}
    if "batchfit" in finders:
        for strategy in STRATEGIES:
            row, results[strategy] = run_batchfit(case, device, steps, strategy, forwards_budget)
            rows.append(row)
    if "lightning" in finders:
        rows += _lightning_rows(case, device, steps, truth)
    if "accelerate" in finders:
        rows += _accelerate_rows(case, device, steps, truth)
    reference = reference or _reference_strategy()
    _compare(rows, truth, reference)
    throughput = {
        strategy: {"points": tried_speeds(result), "knee": knee(tried_speeds(result))}
        for strategy, result in results.items()
    }
    throughput["exhaustive"] = {"points": scan_speeds, "knee": knee(scan_speeds)}
    contention = others_cpu_share(cpu_at_start)
    print_table(case, rows, truth, reference)
    shown = "unknown" if contention is None else f"{contention:.0%}"
    print(f"other processes used {shown} of the machine's cores during this case")
    print_throughput(throughput)
    return {
        "case": case.label,
        "model": case.model,
        "model_kwargs": case.kwargs,
        "amp": case.amp,
        "cap_bytes": case.cap_bytes,
        "truth": truth,
        "reference_strategy": reference,
        "load_average_1min": {"start": load_at_start, "end": _load()},
        "others_cpu_share": contention,
        "rows": [asdict(row) for row in rows],
        "throughput": throughput,
        "results": {name: json.loads(result.to_json()) for name, result in results.items()},
    }


def _load() -> float | None:
    """The 1-minute load average: wall times mean little when other work shares the cores."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process, wall clock), Linux only."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy = (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0.0)) / hz
    times = os.times()
    return busy, times.user + times.system, time.perf_counter()


def others_cpu_share(before: tuple[float, float, float] | None) -> float | None:
    """The share of the machine's cores that *other* processes used since ``before``: near 0 on
    a quiet machine; a case with a large share has wall times that mean little."""
    after = _cpu_snapshot()
    if before is None or after is None or after[2] <= before[2]:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / ((after[2] - before[2]) * (os.cpu_count() or 1)))


def _lightning_rows(case: Case, device: torch.device, steps: int, truth: int) -> list[Row]:
    if not lightning_available():
        return [Row("Lightning", "all modes", skipped="lightning is not installed")]
    above = max(8192, 4 * truth)  # margin 0 and a cap above the truth: neither decides the row
    rows = []
    for mode in ("power", "binsearch"):
        rows.append(run_lightning(case, device, steps, mode, None, None))
        rows.append(run_lightning(case, device, steps, mode, 0.0, above))
    return rows


def _accelerate_rows(case: Case, device: torch.device, steps: int, truth: int) -> list[Row]:
    if not accelerate_available():
        return [Row("Accelerate", "both starts", skipped="accelerate is not installed")]
    return [run_accelerate(case, device, steps, factor * truth, f"{factor}x truth") for factor in (2, 8)]


def _reference_strategy() -> str:
    """batchfit's default strategy: the row the wall-time ratio is taken against."""
    default = Options().strategy  # find()'s default: Options holds every option's
    return default if isinstance(default, str) else "binary"


def _compare(rows: list[Row], truth: int, reference: str) -> None:
    base = next((r.wall_s for r in rows if r.finder == "batchfit" and r.setting == reference), None)
    for row in rows:
        if row.found is not None:
            row.delta = row.found - truth
        if base and row.wall_s is not None:
            row.ratio = row.wall_s / base


# Output -------------------------------------------------------------------------------------------------
COLUMNS = (
    ("finder", "<11"),
    ("setting", "<38"),
    ("found", ">6"),
    ("vs truth", ">8"),
    ("trials", ">6"),
    ("OOMs", ">5"),
    ("wall s", ">7"),
    ("x bf", ">6"),
)


def table_line(cells: list[str], note: str) -> str:
    """One row of the table: fixed-width cells, then a free-text note."""
    return " ".join(f"{cell[:38]:{spec}}" for cell, (_, spec) in zip(cells, COLUMNS)) + f"  {note}"


def print_table(case: Case, rows: list[Row], truth: int, reference: str) -> None:
    print(f"\n{case.label}: truth {truth}; 'x bf' = wall time / batchfit {reference}'s")
    print(table_line([name for name, _ in COLUMNS], "note"))
    for row in rows:
        if row.skipped:
            print(table_line([row.finder, row.setting] + ["-"] * 6, f"skipped: {row.skipped}"))
            continue
        found = "-" if row.found is None else str(row.found)
        delta = "-" if row.delta is None else f"{row.delta:+d}"
        wall = "-" if row.wall_s is None else f"{row.wall_s:.1f}"
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        cells = [row.finder, row.setting, found, delta, str(row.trials), str(row.ooms), wall, ratio]
        print(table_line(cells, row.note))


def print_throughput(throughput: dict[str, Any]) -> None:
    for name, data in throughput.items():
        if name == "exhaustive":
            continue
        points = "  ".join(f"{size}: {rate:,.0f}" for size, rate in data["points"] if rate)
        print(f"samples/s at the sizes batchfit {name} tried: {points}")
        print(f"  knee {_knee_text(data['knee'])}")
    print(f"exhaustive scan knee {_knee_text(throughput['exhaustive']['knee'])}")


def _knee_text(info: dict[str, Any] | None) -> str:
    if info is None:
        return "-"
    return (
        f"{info['knee']} (smallest size with >= {KNEE_FRACTION:.0%} of the best "
        f"{info['best_samples_per_s']:,.0f} samples/s at {info['best_batch']})"
    )


def print_summary(cases: list[dict[str, Any]]) -> None:
    """The headline: trials per finder and case, and how far the size found is from the truth."""
    print("\nSummary: trials (found - truth)")
    names: list[str] = []
    for case in cases:
        for row in case["rows"]:
            key = f"{row['finder']} {row['setting']}"
            if key not in names and not row["skipped"]:
                names.append(key)
    if not names:
        return
    width = max(len(n) for n in names) + 2
    print(" " * width + "".join(f"{c['model'] + ' ' + format_bytes(c['cap_bytes']):>17}" for c in cases))
    for name in names:
        cells = []
        for case in cases:
            row = next((r for r in case["rows"] if f"{r['finder']} {r['setting']}" == name), None)
            cell = "-" if row is None or row["found"] is None else f"{row['trials']} ({row['delta']:+d})"
            cells.append(f"{cell:>17}")
        print(f"{name:<{width}}" + "".join(cells))


def stamp(argv: list[str] | None, device: str = "cpu") -> dict[str, str]:
    """When, how and where a benchmark ran: the first keys of its JSON document."""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "device": device,
    }


def write_results(document: dict[str, Any], out: Path, name: str) -> Path:
    """Write a benchmark's JSON ``document`` to ``out/<name>-<date>-<time>.json`` and say where."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(document, indent=1, default=str) + "\n")
    print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    return path


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"torch": torch.__version__, "batchfit": batchfit.__version__}
    for name in ("lightning", "accelerate"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    return found


# Main -----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (live-tensor cap) or cuda (allocator cap)")
    parser.add_argument("--case", choices=["mlp", "cnn", "gpt"], help="only this model (with --cap: one case)")
    parser.add_argument("--cap", help="memory cap for --case, e.g. 2MB or 13200000")
    parser.add_argument("--steps", type=int, default=3, help="steps per trial for every finder (default 3)")
    parser.add_argument(
        "--finders",
        default="batchfit,lightning,accelerate",
        help="comma-separated subset of batchfit,lightning,accelerate (the exhaustive scan always runs)",
    )
    parser.add_argument("--scan-limit", type=int, default=2048, help="largest size the exhaustive scan tries")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON file")
    parser.add_argument("--no-json", action="store_true", help="print the table only")
    parser.add_argument("--tag", default="", help="appended to the JSON file name")
    parser.add_argument(
        "--reference",
        choices=STRATEGIES,
        default=None,
        help="the batchfit strategy the wall-time ratio is taken against (default: find()'s default)",
    )
    return parser.parse_args(argv)


def select_cases(args: argparse.Namespace, defaults: tuple[Case, ...]) -> list[Case]:
    if args.cap is not None:
        if args.case is None:
            raise SystemExit("--cap needs --case")
        return [Case(args.case, parse_memory_limit(args.cap, None))]
    return [c for c in defaults if args.case is None or c.model == args.case]


def main(
    argv: list[str] | None = None,
    cases: tuple[Case, ...] = CPU_CASES,
    name: str = "compare",
    deadline_s: float | None = None,
) -> dict[str, Any]:
    """Run the selected cases; ``deadline_s``: no case starts after that many seconds."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and cases is CPU_CASES and args.cap is None:
        raise SystemExit("the CPU caps mean nothing on a GPU: run benchmarks/gpu_compare.py (or pass --case and --cap)")
    finders = {f.strip() for f in args.finders.split(",") if f.strip()}
    unknown = finders - {"batchfit", "lightning", "accelerate"}
    if unknown:
        raise SystemExit(f"unknown finder(s): {', '.join(sorted(unknown))}")
    selected = select_cases(args, cases)
    started = time.perf_counter()
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "device": str(device),
        "machine": machine(),
        "versions": versions(),
        "steps_per_trial": args.steps,
    }
    print(
        f"batchfit benchmark on {device}: {meta['machine'].get('gpu') or meta['machine']['cpu']}, "
        f"{meta['machine']['cores']} cores; versions {meta['versions']}"
    )
    recognition = oom_recognition(device)
    meta["oom_recognition"] = recognition
    for peer in ("lightning", "accelerate"):
        verdict = recognition.get(peer)
        if verdict is None:
            print(f"{peer}: not installed, its rows are skipped")
        else:
            said = ", ".join(f"{where}: {'yes' if ok else 'NO'}" for where, ok in verdict.items())
            print(f"{peer} recognises the cap's out-of-memory error as OOM: {said}")
    forwards = find_forwards_budget(device)
    meta["find_forwards_budget"] = forwards
    if not forwards:
        print(
            "note: batchfit.find() does not hand the memory budget to the search yet; the "
            "interpolate rows pass the cap to the strategy directly (the budget find() has on this device)"
        )
    results, skipped = [], []
    for case in selected:
        if deadline_s is not None and time.perf_counter() - started > deadline_s:
            print(f"\n== {case.label} == skipped: the {deadline_s:.0f} s deadline has passed")
            skipped.append(case.label)
            continue
        results.append(run_case(case, device, args.steps, finders, forwards, args.scan_limit, args.reference))
    meta["total_wall_s"] = time.perf_counter() - started
    meta["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    document = {"schema": "batchfit.benchmark/1", **meta, "cases": results, "skipped_cases": skipped}
    print_summary(results)
    print(f"\ntotal {meta['total_wall_s']:.0f} s")
    if not args.no_json:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = args.out / f"{name}-{device.type}-{stamp}{'-' + args.tag if args.tag else ''}.json"
        path.write_text(json.dumps(document, indent=1, default=str) + "\n")
        print(f"wrote {path}")
    return document


if __name__ == "__main__":
    main()
