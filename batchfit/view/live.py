"""A rich live table on a terminal: a row per finished trial, a spinner for the one in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from batchfit.view.cells import BAR_WIDTH, TrialCells, gate_rows, summary_rows, trial_cells

if TYPE_CHECKING:
    from batchfit.report import Result, Trial
    from batchfit.testing import GateReport


def live_display(console: Any, render: Callable[[], Any]) -> Any:
    """A ``rich.live.Live`` redrawing ``render()`` 8 times a second on ``console``: what the model
    prints (warnings included) goes above the table, not onto the spinner line."""
    from rich.live import Live

    return Live(
        console=console,
        get_renderable=render,
        refresh_per_second=8,
        transient=False,
        redirect_stdout=True,
        redirect_stderr=True,
        vertical_overflow="visible",
    )


class LiveView:
    """A rich live table on a terminal (see module docs)."""

    def __init__(self, stream: TextIO, *, no_color: bool | None = None) -> None:
        from rich.console import Console

        self.console = Console(file=stream, no_color=no_color, highlight=False, force_terminal=True)
        self._budget: int | None = None
        self._trials: tuple[Trial, ...] = ()
        self._in_flight: tuple[int, str, float] | None = None  # (batch, kind, started at)
        self._lock = threading.Lock()
        self._live = live_display(self.console, self._render)

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
        from rich.text import Text

        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        for label, value in rows:  # as text, not markup: a note's "[/]" or "[link=...]" is shown as written
            grid.add_row(Text(label), Text(value))
        return grid


#: Terminal width from which the live table shows a bar of the budget beside each peak.
WIDE_COLUMNS = 100


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
