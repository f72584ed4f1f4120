"""What a person sees while a frontier is found: a row per finished length, then the table and chart.

The frontier's algorithm never prints: like a probe it calls ``on_trial_start``, ``callback`` and
``on_start`` for the trials of each length, and ``on_point(point)`` when a length is done. A front
end (``batchfit frontier``, ``batchfit.frontier(progress=True)``) feeds a `FrontierView`:

* on a terminal, a rich live table with a row per finished length and a spinner line for the
  trial in flight ("seq_len 512: trial 3 at batch 64 (search), 1.2 s"), then the frontier's text
  and its chart in colour;
* anywhere else (a pipe, a CI log), one plain line per finished length, then the same text and
  the chart in ASCII, within ``COLUMNS`` when it is set;
* quiet (``--quiet``): nothing while running, one line at the end.

Which length the trials in flight belong to is told by `FrontierView.length_started` when
the caller knows it; otherwise the spinner counts the lengths ("length 2 of 4": the frontier picks
their order), and once every length is done, the trials are the longest length's search.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from batchfit.report.frontier_text import (
    TABLE_TITLES,
    compact_rate,
    format_rate,
    headline_lines,
    point_cells,
    render_frontier,
    summary_rows,
)
from batchfit.view.frontier_chart import frontier_chart
from batchfit.view.live import live_display
from batchfit.view.plain import write_fitted
from batchfit.view.progress import columns, no_color, then

if TYPE_CHECKING:
    from batchfit.report import Frontier, FrontierPoint, Trial

#: ``length_started``'s argument for the search of the longest length at batch 1.
LONGEST = None


class FrontierView:
    """A frontier's progress and its final table and chart, on one stream (see module docs)."""

    def __init__(
        self, stream: TextIO, *, quiet: bool = False, plain: bool | None = None, width: int | None = None
    ) -> None:
        self._out = stream
        self.quiet = quiet
        if plain is None:
            plain = not _interactive(stream)
        self.plain = plain or quiet
        self._width = columns() if width is None else width
        self._lengths: tuple[int, ...] = ()
        self._done: list[FrontierPoint] = []
        self._told: int | None | bool = False  # False: not told, read from the order
        self._trials = 0
        self._in_flight: tuple[int, str, float] | None = None
        self._lock = threading.Lock()
        self._live: Any = None
        self.console: Any = None
        if not self.plain:
            from rich.console import Console

            self.console = Console(file=stream, no_color=no_color(), highlight=False, force_terminal=True)
            self._live = live_display(self.console, self._render)
        self._running = False

    # driven by the front end ----------------------------------------------------------------------
    def start(self, header: Sequence[str], seq_lens: Sequence[int] = ()) -> None:
        """The header lines, and the lengths the frontier will measure (shortest first)."""
        self._lengths = tuple(sorted(set(seq_lens)))
        if self.quiet:
            return
        if self.console is not None:
            for line in header:
                self.console.print(line, style="bold" if line is header[0] else "dim", markup=False)
            self._live.start()
            self._running = True
        else:
            for line in header:
                self._line(line, indent=2)

    def length_started(self, seq_len: int | None) -> None:
        """The trials that follow are at ``seq_len`` (`LONGEST`, ``None``: the search for the
        longest length at batch 1)."""
        with self._lock:
            self._told = seq_len
            self._trials = 0

    def set_budget(self, budget_bytes: int | None) -> None:
        """Nothing: the budget is shown with the frontier (the probe's ``on_start`` calls it)."""

    def trial_started(self, batch_size: int, kind: str) -> None:
        with self._lock:
            self._in_flight = (batch_size, kind, time.monotonic())
        self._refresh()

    def trial_finished(self, trial: Trial) -> None:
        with self._lock:
            self._trials += 1
            self._in_flight = None
        self._refresh()

    def point_finished(self, point: FrontierPoint) -> None:
        with self._lock:
            self._done.append(point)
            self._trials = 0
            if self._told == point.seq_len:
                self._told = False
        if self.console is not None:
            self._refresh()
        elif not self.quiet:
            self._line(point_line(point))

    def stop(self) -> None:
        """Take the live display down (whatever ended the run); nothing for plain lines."""
        with self._lock:
            self._in_flight = None
        if self._running:
            self._running = False
            self._live.stop()

    def summary(self, frontier: Frontier) -> None:
        """The frontier's text and its chart (one line with ``quiet``)."""
        self.stop()
        if self.quiet:
            self._line(quiet_line(frontier))
            return
        if self.console is not None:
            self._rich_summary(frontier)
            chart = frontier_chart(frontier, min(self.console.width, 100), unicode=True)
            self.console.print(chart if isinstance(chart, str) else chart.rich())
            return
        self._line()
        for line in render_frontier(frontier).splitlines():
            # "label    value" rows (and a value's second line): continued under the value
            labelled = (line[18:20] == "  " and not line.startswith(" ")) or line.startswith(" " * 20)
            self._line(line, indent=20 if labelled else 4)
        self._line()
        chart = frontier_chart(frontier, min(self._width or 100, 100))
        for line in (chart if isinstance(chart, str) else chart.plain()).splitlines():
            self._line(line)

    # helpers ----------------------------------------------------------------------------------------
    def current_length(self) -> str:
        """What the trials in flight measure: the length told by `length_started`; else the
        count of lengths done (the frontier picks their order), and once every length is done,
        the search for the longest length at batch 1."""
        told = self._told
        if told is None:
            return "longest length at batch 1"
        if told is not False:
            return f"seq_len {told:,}"
        done, total = len(self._done), len(self._lengths)
        if total and done >= total:
            return "longest length at batch 1"
        return f"length {done + 1} of {total}" if total else f"length {done + 1}"

    def _line(self, text: str = "", indent: int = 4) -> None:
        write_fitted(self._out, text, self._width, indent)

    def _refresh(self) -> None:
        if self._running:
            self._live.refresh()

    def _rich_summary(self, frontier: Frontier) -> None:
        """The frontier's text as rich tables: values wrap under their column."""
        from rich.table import Table
        from rich.text import Text

        self.console.print()
        for i, line in enumerate(headline_lines(frontier)):
            self.console.print(Text(line, style="bold" if i == 0 else ""))
        table = Table(box=None, pad_edge=False, header_style="bold", collapse_padding=True)
        for title in TABLE_TITLES:
            table.add_column(title, justify="right", no_wrap=True)
        for point in frontier.points:
            cells = point_cells(point, frontier.estimated)
            style = "" if point.result.safe_verified else "red"
            table.add_row(*(Text(cell, style=style if k == 2 else "") for k, cell in enumerate(cells)))
        self.console.print(table)
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        for label, value in summary_rows(frontier):
            grid.add_row(Text(label), Text(value))
        self.console.print(grid)
        self.console.print()

    def _render(self):  # type: ignore[no-untyped-def]  # rich renderable
        from rich.console import Group
        from rich.spinner import Spinner
        from rich.table import Table
        from rich.text import Text

        with self._lock:
            done, in_flight, trials = tuple(self._done), self._in_flight, self._trials
            length = self.current_length()
        table = Table(box=None, pad_edge=False, header_style="bold", collapse_padding=True)
        for name in ("seq_len", "max batch", "safe batch", "tokens", "tokens/s", "trials"):
            table.add_column(name, justify="right", no_wrap=True)
        for point in done:
            table.add_row(
                f"{point.seq_len:,}",
                f"{point.max_batch:,}",
                f"{point.safe_batch:,}",
                f"{point.tokens:,}",
                format_rate(point.tokens_per_s),
                str(point.trials),
            )
        if in_flight is None:
            return table
        batch, kind, started = in_flight
        label = f"{length}: trial {trials + 1} at batch {batch} ({kind}), {time.monotonic() - started:.1f} s"
        return Group(table, Spinner("dots", text=Text(label, style="cyan")))


def _interactive(stream: TextIO) -> bool:
    """A terminal that redraws: a TTY, and not ``TERM=dumb``."""
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def point_line(point: FrontierPoint) -> str:
    """A finished length in one plain line."""
    checked = "verified" if point.result.safe_verified else "NOT verified"
    reached = "" if point.result.boundary_reached else f" (boundary not reached: {point.result.stop_reason})"
    rate = "" if not point.tokens_per_s else f", {format_rate(point.tokens_per_s)} tokens/s"
    return (
        f"seq_len {point.seq_len:,}: max batch {point.max_batch:,}{reached}, safe {point.safe_batch:,} {checked}"
        f", {point.tokens:,} tokens{rate}, {point.trials} trials"
    )


def quiet_line(frontier: Frontier) -> str:
    """``--quiet``'s one line: ``seq_len:max/safe`` per length, the token budget, the longest length."""
    points = " ".join(f"{p.seq_len}:{p.max_batch}/{p.safe_batch}" for p in frontier.points)
    longest = "" if frontier.longest_at_batch_1 is None else f" longest_at_batch_1={frontier.longest_at_batch_1}"
    budget = f" token_budget={frontier.token_budget} safe_token_budget={frontier.safe_token_budget}" if points else ""
    fastest = frontier.fastest
    best = "" if fastest is None else f" fastest={fastest.seq_len}:{compact_rate(fastest.tokens_per_s)}tok/s"
    return f"seq_len:max/safe {points}{budget}{longest}{best}".strip()


class FrontierProgress:
    """``batchfit.frontier(progress=True)``: the command line's frontier view on stderr, fed by
    the frontier's callbacks (the user's own still run after it). A context manager, so the live
    display always comes down, whatever ends the run::

        with FrontierProgress(type(model).__name__, seq_lens, on_point, callback, on_trial_start,
                              on_start) as shown:
            hooks = shown.callbacks()  # on_point, callback, on_trial_start, on_start
            ...                        # shown.length_started(s) before each length (optional)
            shown.summary(frontier)
    """

    def __init__(
        self,
        what: str,
        seq_lens: Sequence[int],
        on_point: Callable[[FrontierPoint], None] | None = None,
        callback: Callable[[Trial], None] | None = None,
        on_trial_start: Callable[[int, str], None] | None = None,
        on_start: Callable[[Any, int | None], None] | None = None,
        *,
        stream: TextIO | None = None,
    ) -> None:
        self.view = FrontierView(stream if stream is not None else sys.stderr)
        self._what = what
        self._lengths = tuple(seq_lens)
        self._user = (on_point, callback, on_trial_start, on_start)
        self._started = False

    def __enter__(self) -> FrontierProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.view.stop()

    def length_started(self, seq_len: int | None) -> None:
        """Optional: the trials that follow are at ``seq_len`` (``None``: the longest length's search)."""
        self.view.length_started(seq_len)

    def callbacks(self) -> dict[str, Any]:
        """``on_point``, ``callback``, ``on_trial_start`` and ``on_start``, for the frontier's loop."""
        on_point, callback, on_trial_start, on_start = self._user

        def started(device: Any, budget: int | None) -> None:
            if not self._started:  # once: every length's probe says it
                lengths = ", ".join(f"{s:,}" for s in sorted(set(self._lengths)))
                where = getattr(device, "name", None) or getattr(device, "type", device)
                self.view.start([f"batchfit: frontier of {self._what} on {where} at seq_len {lengths}"], self._lengths)
                self._started = True
            if on_start is not None:
                on_start(device, budget)

        return {
            "on_point": then(self.view.point_finished, on_point),
            "callback": then(self.view.trial_finished, callback),
            "on_trial_start": then(self.view.trial_started, on_trial_start),
            "on_start": started,
        }

    def summary(self, frontier: Frontier) -> None:
        self.view.summary(frontier)
