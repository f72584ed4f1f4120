"""The strings every view shows: one trial as cells, the summary rows, the gate's rows.

The live, plain and quiet views all read these, so the numbers cannot differ between a terminal
and a CI log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchfit.report import device_text
from batchfit.report.text import evaluation_rows, generation_rows
from batchfit.units import format_bytes, format_duration

if TYPE_CHECKING:  # the view only reads these; importing them must not pull torch in
    from batchfit.report import MemoryModel, Result, Trial
    from batchfit.testing import GateReport

BAR_WIDTH = 20


# Formatting shared by every view ------------------------------------------------------------
@dataclass(frozen=True)
class TrialCells:
    """One trial as the strings every view shows."""

    index: str
    batch: str
    kind: str
    outcome: str
    peak: str
    fraction: float | None  # peak / budget, None when either is unknown
    share: str  # fraction as a percentage, "" when unknown
    step: str
    rate: str
    fits: bool


def trial_cells(index: int, trial: Trial, budget_bytes: int | None) -> TrialCells:
    """Format one trial. A failed trial's peak is a lower bound of what that size needs (what
    was held when it failed, plus the refused request where the backend states it), hence the
    ``>=``."""
    retries = trial.allocator.retries if trial.allocator is not None else 0
    if trial.fits:
        outcome = f"fits, {retries} retries" if retries else "fits"  # reported, not failed on (expandable)
    elif trial.refused_for_retry:
        outcome = f"retry in {trial.phase}"  # ran only by flushing the cache: does not fit (native)
    else:
        outcome = f"OOM in {trial.phase}" if trial.phase else "OOM"
    value = trial.capped_peak_bytes
    peak = format_bytes(value)
    if not trial.fits and value is not None:
        peak = ">=" + peak
    fraction = None
    if value is not None and budget_bytes:
        fraction = value / budget_bytes
    return TrialCells(
        index=str(index),
        batch=str(trial.batch_size),
        kind=trial.kind,
        outcome=outcome,
        peak=peak,
        fraction=fraction,
        share="" if fraction is None else f"{fraction:.0%}",
        step="-" if trial.step_time_s is None else format_duration(trial.step_time_s),
        rate="-" if trial.samples_per_s is None else f"{trial.samples_per_s:,.1f}",
        fits=trial.fits,
    )


def ascii_bar(fraction: float | None, width: int = BAR_WIDTH) -> str:
    """``[#######.............]``; a peak over the budget fills the bar and ends in ``!``."""
    if fraction is None:
        return ""
    filled = max(0, min(width, round(fraction * width)))
    return "[" + "#" * filled + "." * (width - filled) + ("!" if fraction > 1 else "]")


def memory_equation(memory: MemoryModel) -> list[str]:
    """The fitted equation in the terms a reader reasons in: weights + gradients + optimizer
    state + per-sample activations and data.

    ``fixed_bytes`` is the intercept of the phase that decides the boundary. When the measured
    weights, gradients and optimizer state fit inside it, it is shown as their sum plus the rest
    (the sample, buffers, temporaries). When they do not (at a backward peak only part of the
    gradients exists yet; at a forward peak none), the intercept is shown as one number and the
    parts are listed under it, rather than forced into a sum that would not add up.
    """
    per_sample = f"{format_bytes(memory.per_sample_bytes)}/sample (activations and data) x batch"
    parts = [
        ("weights", memory.weights_bytes),
        ("gradients", memory.gradient_bytes),
        ("optimizer state", memory.optimizer_state_bytes),
    ]
    known = sum(nbytes for _, nbytes in parts)
    other = memory.fixed_bytes - known
    if known and other >= 0:
        terms = [f"{format_bytes(nbytes)} {name}" for name, nbytes in parts] + [f"{format_bytes(other)} other"]
        return [f"peak ~ {' + '.join(terms)}", f"  + {per_sample}  ({memory.phase} peak)"]
    listed = " + ".join(f"{name} {format_bytes(nbytes)}" for name, nbytes in parts)
    return [
        f"peak ~ {format_bytes(memory.fixed_bytes)} + {per_sample}  ({memory.phase} peak)",
        f"  of which {listed}, not all live at that peak",
    ]


def device_label(result: Result) -> str:
    """The device and its total memory: the runtime's total (what fractions and budgets are of)
    and, where NVML gave it, nvidia-smi's, which also counts driver-reserved memory."""
    device = result.device
    total = f", {format_bytes(device.total_bytes)} total" if device.total_bytes else ""
    if device.nvml_total_bytes and device.nvml_total_bytes != device.total_bytes:
        total += f" ({format_bytes(device.nvml_total_bytes)} in nvidia-smi)"
    return device_text(device) + total


def summary_rows(result: Result) -> list[tuple[str, str]]:
    """Label/value rows of the summary: the answers first, then how they were measured."""
    settings = result.settings
    timed = [t for t in result.trials if t.fits and t.batch_size == result.best_throughput_batch and t.samples_per_s]
    best = max(timed, key=lambda t: t.samples_per_s or 0.0, default=None)
    max_note = (
        f"  (batch {_first_failure_above(result)} ran out of memory)"
        if result.boundary_reached
        else f"  (boundary not reached: {result.stop_reason})"
    )
    best_rate = result.throughput.best_samples_per_s if result.throughput is not None else None
    best_rate = best_rate or (best.samples_per_s if best else None)  # the rate the answer ranked
    rate = f"  ({best_rate:,.1f} samples/s)" if best_rate else ""
    checked = "checked on fake steps" if result.estimated else f"verified over {settings.verify_steps} steps"
    rows = [
        ("max batch", f"{result.max_batch}{max_note}"),
        (
            "safe batch",
            f"{result.safe_batch}  (leaves {settings.headroom:.0%} headroom; "
            + (f"{checked})" if result.safe_verified else "NOT verified)"),
        ),
        (
            "best throughput",
            "not measured: an estimate times nothing" if result.estimated else f"{result.best_throughput_batch}{rate}",
        ),
    ]
    if result.world_size > 1:
        rows.append(
            (
                "ranks",
                f"{result.world_size}: batch sizes are per rank; global max batch {result.global_max_batch}, "
                f"safe {result.global_safe_batch}; samples/s of the whole group",
            )
        )
    throughput = result.throughput
    if throughput is not None:
        noise = "" if throughput.spread is None else f"; repeated steps spread {throughput.spread:.0%}"
        noise += (
            f"; {len(throughput.rates)} sizes timed warm alike" if throughput.warm else "; from the search's cold steps"
        )
        rows.append(
            (
                "throughput knee",
                f"{throughput.knee_batch}  ({throughput.knee_samples_per_s:,.1f} samples/s, "
                f"within 5% of the best{noise})",
            )
        )
    rows += evaluation_rows(result) + generation_rows(result)
    if result.memory is not None:
        first, *rest = memory_equation(result.memory)
        rows.append(("memory", first.strip()))
        rows.extend(("", line) for line in rest)
    else:
        rows.append(("memory", "no equation: fewer than two batch sizes fitted"))
    counts = "; counts reserved bytes" if result.budget_counts == "reserved" else ""
    rows.append(("budget", f"{format_bytes(result.budget_bytes)} ({settings.limit_source}{counts})"))
    mode = settings.mode + (f", amp {settings.amp}" if settings.amp else "")
    rows.append(("device", f"{device_label(result)}; {mode}; torch {result.torch_version}"))
    if result.device.config:
        rows.append(("config", ", ".join(f"{key} {value}" for key, value in result.device.config)))
    rows.append(("trials", f"{len(result.trials)} in {result.elapsed_s:.1f} s"))
    rows.extend(("note", note) for note in result.notes)
    rows.extend(("assumes", assumption) for assumption in result.assumptions)
    return rows


def _first_failure_above(result: Result) -> str:
    above = [t.batch_size for t in result.search_trials if not t.fits and t.batch_size > result.max_batch]
    return str(min(above)) if above else "?"


def quiet_line(result: Result) -> str:
    ranks = f" world_size={result.world_size}" if result.world_size > 1 else ""
    return (
        f"max_batch={result.max_batch} safe_batch={result.safe_batch} "
        f"best_throughput_batch={result.best_throughput_batch} budget={format_bytes(result.budget_bytes)}{ranks}"
    )


def gate_rows(report: GateReport) -> list[tuple[str, str]]:
    """The gate's verdict: the peak at the required batch against the limit, and on failure the
    largest batch that did fit."""
    trial = report.trial
    peak = format_bytes(trial.capped_peak_bytes)
    verdict = (
        f"PASS: batch {report.batch_size} fits"
        if report.fits
        else f"FAIL: batch {report.batch_size} does not fit (OOM in {trial.phase or '?'})"
    )
    rows = [
        ("gate", verdict),
        ("peak", f"{'' if trial.fits else '>='}{peak} of {format_bytes(report.budget_bytes)} limit"),
    ]
    if not report.fits:
        if report.largest_fit is None:
            rows.append(("largest fit", "not searched (init_batch is above the required batch)"))
        else:
            rows.append(("largest fit", str(report.largest_fit) if report.largest_fit else "none, not even batch 1"))
    rows.append(("device", report.device_text))
    return rows
