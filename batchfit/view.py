"""What a person sees while a probe runs: a rich live view on a terminal, plain lines elsewhere.

The finder never prints; it calls ``on_trial_start(batch_size, kind)`` before a trial and
``callback(trial)`` after it. A view turns those calls into output:

* :class:`LiveView` (a terminal): a table that grows by one row per finished trial, a spinner
  line for the trial in flight, then a summary panel. Colours follow ``NO_COLOR``.
* :class:`PlainView` (a pipe, a file, a CI log): one plain line per finished trial as it
  finishes, then the summary as aligned lines. No escape codes, no spinner, nothing that redraws,
  so a CI log reads like the terminal's final frame.
* :class:`QuietView` (``--quiet``): nothing while running, one line at the end.

All three read the same formatted cells (:func:`trial_cells`, :func:`summary_rows`), so the
numbers cannot differ between a terminal and a log.

When the reader of a plain or quiet view goes away (``batchfit probe ... | head -1``), its next
write raises :class:`OutputClosedError`, a ``BrokenPipeError`` of the view's own, so the CLI can
tell it from one raised by the user's model (a data pipe) and stop quietly.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from batchfit.units import format_bytes

if TYPE_CHECKING:  # the view only reads these; importing them must not pull torch in
    from batchfit.nvml import DevicesReport, Gpu, MigDevice
    from batchfit.result import MemoryModel, Result, Trial
    from batchfit.testing import GateReport

BAR_WIDTH = 20


class OutputClosedError(BrokenPipeError):
    """The stream a view writes to was closed by its reader (``| head``)."""


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
    if trial.fits:
        outcome = "fits"
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
        step="-" if trial.step_time_s is None else _duration(trial.step_time_s),
        rate="-" if trial.samples_per_s is None else f"{trial.samples_per_s:,.1f}",
        fits=trial.fits,
    )


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


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
    from batchfit.testing import device_text

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
    rate = f"  ({best.samples_per_s:,.1f} samples/s)" if best and best.samples_per_s else ""
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
        rows.append(
            (
                "throughput knee",
                f"{throughput.knee_batch}  ({throughput.knee_samples_per_s:,.1f} samples/s, "
                f"within 5% of the best{noise})",
            )
        )
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


# The three views --------------------------------------------------------------------------------
class View(Protocol):
    """What the CLI drives; ``find()``'s callbacks map onto the first two methods."""

    def start(self, header: Sequence[str], budget_bytes: int | None) -> None: ...
    def trial_started(self, batch_size: int, kind: str) -> None: ...
    def trial_finished(self, trial: Trial) -> None: ...
    def set_budget(self, budget_bytes: int | None) -> None: ...
    def stop(self) -> None: ...
    def summary(self, result: Result) -> None: ...
    def gate(self, report: GateReport) -> None: ...


class PlainView:
    """Plain lines for pipes and CI logs (see module docs)."""

    _COLUMNS = ("#", "batch", "kind", "outcome", "peak", "", "step", "samples/s")

    def __init__(self, stream: TextIO) -> None:
        self._out = stream
        self._budget: int | None = None
        self._count = 0
        self._header_printed = False

    def _line(self, text: str = "") -> None:
        try:
            self._out.write(text + "\n")
            self._out.flush()
        except BrokenPipeError as exc:
            raise OutputClosedError(exc.errno, exc.strerror) from None

    def start(self, header: Sequence[str], budget_bytes: int | None) -> None:
        self._budget = budget_bytes
        for line in header:
            self._line(line)

    def set_budget(self, budget_bytes: int | None) -> None:
        self._budget = budget_bytes

    def trial_started(self, batch_size: int, kind: str) -> None:
        """Nothing: a CI log gets one line per trial, when it has an outcome."""

    def trial_finished(self, trial: Trial) -> None:
        if not self._header_printed:
            self._line(self._format(self._COLUMNS, bar="of budget".ljust(BAR_WIDTH + 2)))
            self._header_printed = True
        self._count += 1
        cells = trial_cells(self._count, trial, self._budget)
        row = (cells.index, cells.batch, cells.kind, cells.outcome, cells.peak, cells.share, cells.step, cells.rate)
        self._line(self._format(row, bar=ascii_bar(cells.fraction).ljust(BAR_WIDTH + 2)))

    @staticmethod
    def _format(cells: Sequence[str], bar: str) -> str:
        i, batch, kind, outcome, peak, share, step, rate = cells
        return (
            f"{i:>3}  {batch:>7}  {kind:<6}  {outcome:<16}  {peak:>13}  {bar} {share:>5}  {step:>10}  {rate:>11}"
        ).rstrip()

    def stop(self) -> None:
        """Nothing to take down."""

    def summary(self, result: Result) -> None:
        self._line()
        self._rows(summary_rows(result))

    def gate(self, report: GateReport) -> None:
        self._line()
        self._rows(gate_rows(report))

    def _rows(self, rows: Sequence[tuple[str, str]]) -> None:
        width = max(len(label) for label, _ in rows)
        for label, value in rows:
            self._line(f"{label:<{width}}  {value}".rstrip())


class QuietView(PlainView):
    """``--quiet``: no progress, no table; one line with the answer."""

    def start(self, header: Sequence[str], budget_bytes: int | None) -> None:
        self._budget = budget_bytes

    def trial_finished(self, trial: Trial) -> None:
        """Nothing while running."""

    def summary(self, result: Result) -> None:
        self._line(quiet_line(result))

    def gate(self, report: GateReport) -> None:
        self._line(gate_rows(report)[0][1])


class LiveView:
    """A rich live table on a terminal (see module docs)."""

    def __init__(self, stream: TextIO, *, no_color: bool | None = None) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console(file=stream, no_color=no_color, highlight=False, force_terminal=True)
        self._budget: int | None = None
        self._trials: tuple[Trial, ...] = ()
        self._in_flight: tuple[int, str, float] | None = None  # (batch, kind, started at)
        self._lock = threading.Lock()
        self._live = Live(
            console=self.console,
            get_renderable=self._render,
            refresh_per_second=8,
            transient=False,
            # What the model prints (warnings included) goes above the table, not onto the spinner line.
            redirect_stdout=True,
            redirect_stderr=True,
            vertical_overflow="visible",
        )

    # driven by the CLI ------------------------------------------------------------------------
    def start(self, header: Sequence[str], budget_bytes: int | None) -> None:
        self._budget = budget_bytes
        for line in header:
            self.console.print(line, style="bold" if line is header[0] else "dim")
        self._live.start()

    def set_budget(self, budget_bytes: int | None) -> None:
        self._budget = budget_bytes

    def trial_started(self, batch_size: int, kind: str) -> None:
        with self._lock:
            self._in_flight = (batch_size, kind, time.monotonic())
        self._live.refresh()

    def trial_finished(self, trial: Trial) -> None:
        with self._lock:
            self._trials = (*self._trials, trial)
            self._in_flight = None
        self._live.refresh()

    def stop(self) -> None:
        with self._lock:
            self._in_flight = None
        self._live.stop()

    def summary(self, result: Result) -> None:
        from rich.panel import Panel

        self.console.print(Panel(self._grid(summary_rows(result)), title="batchfit", expand=False))

    def gate(self, report: GateReport) -> None:
        from rich.panel import Panel

        style = "green" if report.fits else "red"
        self.console.print(Panel(self._grid(gate_rows(report)), title="gate", border_style=style, expand=False))

    # rendering ----------------------------------------------------------------------------------
    def _render(self):  # type: ignore[no-untyped-def]  # rich renderable
        from rich.console import Group
        from rich.spinner import Spinner
        from rich.table import Table
        from rich.text import Text

        with self._lock:
            trials, in_flight, budget = self._trials, self._in_flight, self._budget
        # Below WIDE_COLUMNS the bar goes and the share stays, so every cell reads whole at 80.
        wide = self.console.width >= WIDE_COLUMNS
        table = Table(box=None, pad_edge=False, header_style="bold", collapse_padding=True)
        for name, justify in (
            ("#", "right"),
            ("batch", "right"),
            ("kind", "left"),
            ("outcome", "left"),
            ("peak", "right"),
            ("of budget" if wide else "budget", "left" if wide else "right"),
            ("step", "right"),
            ("samples/s", "right"),
        ):
            table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
        for i, trial in enumerate(trials, start=1):
            cells = trial_cells(i, trial, budget)
            outcome = Text(cells.outcome, style="green" if cells.fits else "red")
            share = _rich_bar(cells) if wide else cells.share
            table.add_row(cells.index, cells.batch, cells.kind, outcome, cells.peak, share, cells.step, cells.rate)
        if in_flight is None:
            return table
        batch, kind, started = in_flight
        label = f"trial {len(trials) + 1}: batch {batch} ({kind}), {time.monotonic() - started:.1f} s"
        return Group(table, Spinner("dots", text=Text(label, style="cyan")))

    @staticmethod
    def _grid(rows: Sequence[tuple[str, str]]):  # type: ignore[no-untyped-def]
        from rich.table import Table

        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        for label, value in rows:
            grid.add_row(label, value)
        return grid


#: Terminal width from which the live table shows a bar of the budget beside each peak.
WIDE_COLUMNS = 100


class Progress:
    """``find(progress=True)``: the command line's view on stderr, fed by find()'s callbacks (the
    user's own still run after it). Used as a context manager, so the live display always comes
    down, whatever ends the probe."""

    def __init__(
        self,
        what: str,
        callback: Callable[[Trial], None] | None,
        on_trial_start: Callable[[int, str], None] | None,
        on_start: Callable[[Any, int | None], None] | None,
    ) -> None:
        import sys

        self.view = make_view(sys.stderr)
        self._what = what
        self._user = (callback, on_trial_start, on_start)
        self._started = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._started:
            self.view.stop()

    def callbacks(self) -> dict[str, Any]:
        callback, on_trial_start, on_start = self._user

        def started(device: Any, budget: int | None) -> None:
            self.view.start([f"batchfit: probing {self._what} on {device.name or device.type}"], budget)
            self._started = True
            if on_start is not None:
                on_start(device, budget)

        def trial_started(batch_size: int, kind: str) -> None:
            self.view.trial_started(batch_size, kind)
            if on_trial_start is not None:
                on_trial_start(batch_size, kind)

        def finished(trial: Trial) -> None:
            self.view.trial_finished(trial)
            if callback is not None:
                callback(trial)

        return {"callback": finished, "on_trial_start": trial_started, "on_start": started}

    def summary(self, result: Result) -> None:
        if self._started:
            self.view.stop()
            self._started = False
        self.view.summary(result)


def _rich_bar(cells: TrialCells):  # type: ignore[no-untyped-def]
    from rich.text import Text

    if cells.fraction is None:
        return Text("")
    filled = max(0, min(BAR_WIDTH, round(cells.fraction * BAR_WIDTH)))
    colour = "green" if cells.fraction < 0.75 else "yellow" if cells.fraction <= 1 else "red"
    bar = Text("█" * filled, style=colour)
    bar.append("░" * (BAR_WIDTH - filled), style="dim")
    bar.append(f" {cells.share:>5}")
    return bar


# devices ----------------------------------------------------------------------------------------
def devices_lines(report: DevicesReport) -> list[str]:
    """``batchfit devices`` as plain lines: what nvidia-smi would tell before a run.

    ``GPU n`` is NVML's index (PCI bus order, as nvidia-smi numbers them); ``cuda:n`` beside it is
    the index torch uses for the same GPU, matched by UUID, which can differ even without
    ``CUDA_VISIBLE_DEVICES`` (CUDA orders fastest first by default). MIG instances are indented
    under their GPU with the UUID that ``CUDA_VISIBLE_DEVICES`` takes; a GPU NVML cannot open is
    listed with the reason."""
    if report.unavailable:
        return [report.unavailable]
    torch_knows = report.cuda_device_count is not None

    def memory(used: int | None, free: int | None, total: int | None) -> str:
        return f"memory {format_bytes(used)} used / {format_bytes(free)} free / {format_bytes(total)} total"

    def torch_index(cuda_index: int | None) -> str:
        if cuda_index is not None:
            return f" (cuda:{cuda_index})"
        return " (not visible to torch)" if torch_knows else ""

    def gpu_lines(gpu: Gpu) -> list[str]:
        if gpu.unreadable:
            return [f"GPU {gpu.index}: cannot be read: {gpu.unreadable}"]
        util = "-" if gpu.gpu_utilization is None else f"{gpu.gpu_utilization}%"
        # in MIG mode torch sees the instances, never the GPU itself: say nothing rather than "not visible"
        index = "" if gpu.mig_enabled and gpu.cuda_index is None else torch_index(gpu.cuda_index)
        mig = f"  MIG on, {len(gpu.mig_devices)} instance(s)" if gpu.mig_enabled else ""
        out = [
            f"GPU {gpu.index}{index}: {gpu.name or '?'}  {memory(gpu.used_bytes, gpu.free_bytes, gpu.total_bytes)}"
            f"  utilisation {util}{mig}"
        ]
        out.extend(mig_line(instance) for instance in gpu.mig_devices)
        if gpu.mig_enabled and not gpu.mig_devices:
            out.append("    no MIG instances created")
        if not gpu.processes:
            out.append("    no processes hold memory")
        for proc in gpu.processes:
            out.append(f"    pid {proc.pid:<8} {format_bytes(proc.used_bytes):>11}  {proc.kind:<8} {proc.name}")
        return out

    def mig_line(instance: MigDevice) -> str:
        if instance.unreadable:
            return f"    MIG {instance.index}: cannot be read: {instance.unreadable}"
        ids = ""
        if instance.gpu_instance_id is not None and instance.compute_instance_id is not None:
            ids = f"  GI {instance.gpu_instance_id} CI {instance.compute_instance_id}"
        used, free, total = instance.used_bytes, instance.free_bytes, instance.total_bytes
        return (
            f"    MIG {instance.index}{torch_index(instance.cuda_index)}: {instance.name or '?'}{ids}  "
            f"{memory(used, free, total)}  {instance.uuid or 'uuid ?'}"
        )

    lines = [
        f"NVIDIA driver {report.driver_version or '?'}, CUDA {report.cuda_version or '?'}, {len(report.gpus)} GPU(s)"
    ]
    env = [
        f"{name}={value}"
        for name, value in (
            ("CUDA_VISIBLE_DEVICES", report.cuda_visible_devices),
            ("CUDA_DEVICE_ORDER", report.cuda_device_order),
        )
        if value is not None
    ]
    if env:
        lines.append("  ".join(env))
    if not torch_knows and (len(report.gpus) > 1 or report.cuda_visible_devices is not None):
        lines.append("GPU n below is NVML's index; torch's cuda:n is unknown here (no torch or no CUDA) and may differ")
    elif torch_knows and any(gpu.cuda_index != gpu.index for gpu in report.gpus if not gpu.mig_enabled):
        lines.append("GPU n is NVML's index (PCI bus order, as nvidia-smi); cuda:n is torch's for the same GPU")
    for gpu in report.gpus:
        lines.extend(gpu_lines(gpu))
    return lines


def make_view(stream: TextIO, *, quiet: bool = False, plain: bool | None = None) -> View:
    """The view for ``stream``: live on an interactive terminal, plain lines anywhere else.

    ``plain=None`` decides from the stream: not a TTY, or ``TERM=dumb``, means plain.
    """
    if quiet:
        return QuietView(stream)
    if plain is None:
        plain = not _is_tty(stream) or os.environ.get("TERM") == "dumb"
    if plain:
        return PlainView(stream)
    return LiveView(stream, no_color=no_color())


def no_color() -> bool:
    """https://no-color.org: any non-empty ``NO_COLOR`` turns colour off."""
    return os.environ.get("NO_COLOR", "") != ""


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed stream
        return False
