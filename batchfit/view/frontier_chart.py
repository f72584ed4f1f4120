"""A frontier as a text chart: batch size against sequence length, both axes log2.

One layout, drawn two ways: `Chart.plain` (ASCII, for pipes and CI logs) and
`Chart.rich` (box-drawing characters and colours, for a terminal). Pure rendering of a
[`Frontier`][batchfit.Frontier]: nothing is measured or fitted here.

::

            batch
      128 ┤ M 237k
       64 ┤        M 183k
       32 ┤                M 193k
          ...
        1 ┤                  ·  ·  ·  ·  ·  L
          └─┬──────┬───────┬──────────────┬─
  seq_len   32     64     128            900
  max      118     58      29              1
  safe     106     52      26
  tok/s   237k   183k    193k

``M`` the max batch, ``s`` the safe batch (where it has a row of its own; else the max batch's
marker stands for both), the safe batch's tokens/s beside it, ``L`` the longest length at batch 1,
dots the fitted surface at the budget. The rows under the axis give every number exactly.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchfit.report.frontier_text import compact_rate

if TYPE_CHECKING:
    from batchfit.report import Frontier

#: Plot rows (batch sizes, log2) of a chart.
HEIGHT = 10
#: The width a chart takes where none is given (a pipe without ``COLUMNS``).
DEFAULT_WIDTH = 72
#: Narrower than this the chart is not drawn (the table says the numbers).
MIN_WIDTH = 40

_STYLES = {"M": "bold green", "s": "cyan", "L": "bold magenta", "rate": "yellow", "surface": "dim", "axis": "dim"}
_ASCII = {"tick": "+", "rule": "|", "corner": "+", "line": "-", "mark": "+", "dot": "."}
_BOXES = {"tick": "┤", "rule": "│", "corner": "└", "line": "─", "mark": "┬", "dot": "·"}


@dataclass(frozen=True)
class Chart:
    """A drawn chart: lines of ``(text, style)`` runs (style ``""``: none)."""

    lines: tuple[tuple[tuple[str, str], ...], ...]

    def plain(self) -> str:
        """The chart as plain text: no escape codes."""
        return "\n".join("".join(text for text, _ in line).rstrip() for line in self.lines)

    def rich(self) -> Any:
        """The chart as a ``rich.text.Text`` with its colours."""
        from rich.text import Text

        text = Text(no_wrap=True, overflow="crop")
        for i, line in enumerate(self.lines):
            if i:
                text.append("\n")
            keep = len("".join(run for run, _ in line).rstrip())  # as plain() has it: no trailing spaces
            for run, style in line:
                if keep <= 0:
                    break
                text.append(run[:keep], style=style or None)
                keep -= len(run)
        return text


def frontier_chart(frontier: Frontier, width: int | None = None, *, unicode: bool = False) -> Chart | str:
    """The chart of ``frontier`` within ``width`` columns (`DEFAULT_WIDTH` when ``None``);
    ASCII unless ``unicode``. A one-line reason (a ``str``) when there is nothing to draw or it
    cannot be drawn that narrow."""
    if not frontier.points:
        return "no chart: no length was measured"
    width = DEFAULT_WIDTH if width is None else width
    glyphs = _BOXES if unicode else _ASCII
    return _Drawing(frontier, glyphs).draw(width)


def chart_text(frontier: Frontier, width: int | None = None) -> str:
    """The plain chart, or the line that says why there is none."""
    chart = frontier_chart(frontier, width)
    return chart if isinstance(chart, str) else chart.plain()


class _Canvas:
    def __init__(self, rows: int, cols: int) -> None:
        self.cells = [[" "] * cols for _ in range(rows)]
        self.styles = [[""] * cols for _ in range(rows)]
        self.used = [[False] * cols for _ in range(rows)]  # a label's spaces are taken too

    def put(self, row: int, col: int, text: str, style: str = "", *, only_empty: bool = False) -> bool:
        if row < 0 or row >= len(self.cells) or col < 0 or col + len(text) > len(self.cells[row]):
            return False
        if only_empty and any(self.used[row][col : col + len(text)]):
            return False
        for i, char in enumerate(text):
            self.cells[row][col + i] = char
            self.styles[row][col + i] = style
            self.used[row][col + i] = True
        return True

    def lines(self) -> tuple[tuple[tuple[str, str], ...], ...]:
        out = []
        for chars, styles in zip(self.cells, self.styles):
            runs: list[tuple[str, str]] = []
            for char, style in zip(chars, styles):
                if runs and runs[-1][1] == style:
                    runs[-1] = (runs[-1][0] + char, style)
                else:
                    runs.append((char, style))
            out.append(tuple(runs))
        return tuple(out)


class _Drawing:
    """Lays a frontier out on a canvas (see the module docs for the picture)."""

    def __init__(self, frontier: Frontier, glyphs: dict[str, str]) -> None:
        self.frontier = frontier
        self.glyphs = glyphs
        points = frontier.points
        self.longest = frontier.longest_at_batch_1
        lengths = sorted({p.seq_len for p in points} | ({self.longest} if self.longest else set()))
        self.lengths = lengths
        batches = [b for p in points for b in (p.max_batch, p.safe_batch)] + ([1] if self.longest else [])
        self.low = math.floor(math.log2(min(batches)))
        self.high = max(math.ceil(math.log2(max(batches))), self.low + 1)
        by_length = {p.seq_len: p for p in points}
        self.labels = {
            "seq_len": [f"{s:,}" for s in lengths],
            "max": [f"{by_length[s].max_batch:,}" if s in by_length else "1" for s in lengths],
            "safe": [f"{by_length[s].safe_batch:,}" if s in by_length else "" for s in lengths],
            "tok/s": [compact_rate(by_length[s].tokens_per_s) if s in by_length else "" for s in lengths],
        }
        self.gutter = max(7, len(f"{2**self.high:,}")) + 2

    def row_of(self, batch: float) -> int:
        share = (math.log2(batch) - self.low) / (self.high - self.low)
        return HEIGHT - 1 - round(share * (HEIGHT - 1))

    def columns(self, plot_width: int) -> list[int] | None:
        """The column of each length: log2-spaced where the labels keep apart, evenly spaced where
        they would not, ``None`` where even that is too narrow."""
        cell = max(len(label) for labels in self.labels.values() for label in labels) + 2
        margin = cell // 2 + 1
        usable = plot_width - 2 * margin
        n = len(self.lengths)
        if n == 1:
            return [plot_width // 2] if plot_width >= cell else None
        if usable < (n - 1) * cell:
            return None
        logs = [math.log2(s) for s in self.lengths]
        spread = logs[-1] - logs[0]
        placed = [margin + round((x - logs[0]) / spread * usable) for x in logs]
        if all(b - a >= cell for a, b in zip(placed, placed[1:])):
            return placed
        step = usable / (n - 1)
        return [margin + round(i * step) for i in range(n)]

    def draw(self, width: int) -> Chart | str:
        if width < MIN_WIDTH:
            return f"no chart: it needs at least {MIN_WIDTH} columns"
        plot_width = width - self.gutter - 1
        columns = self.columns(plot_width)
        if columns is None:
            return f"no chart: {len(self.lengths)} lengths need more than {width} columns"
        g = self.glyphs
        rows = 2 + HEIGHT + 2 + len(self.labels) - 1  # title, "batch", the plot, the axis, the value rows
        canvas = _Canvas(rows, width)
        top = 2
        x0 = self.gutter + 1  # column 0 of the plot
        canvas.put(0, 0, "batch size by sequence length (log2 axes)"[:width])
        canvas.put(1, 0, f"{'batch':>{self.gutter - 2}}", "axis")
        for r in range(HEIGHT):
            canvas.put(top + r, self.gutter - 1, g["rule"], "axis")
        for power in range(self.low, self.high + 1):
            r = self.row_of(2**power)
            if not canvas.used[top + r][self.gutter - 2]:
                canvas.put(top + r, 0, f"{2**power:>{self.gutter - 2},}", "axis")
                canvas.put(top + r, self.gutter - 1, g["tick"], "axis")
        by_length = {p.seq_len: p for p in self.frontier.points}
        for i, (s, col) in enumerate(zip(self.lengths, columns)):
            point = by_length.get(s)
            if point is None:
                canvas.put(top + self.row_of(1), x0 + col, "L", _STYLES["L"])
                continue
            max_row, safe_row = self.row_of(point.max_batch), self.row_of(point.safe_batch)
            canvas.put(top + max_row, x0 + col, "M", _STYLES["M"])
            if safe_row != max_row:
                canvas.put(top + safe_row, x0 + col, "s", _STYLES["s"])
            if point.tokens_per_s:
                label = " " + compact_rate(point.tokens_per_s)
                room = (columns[i + 1] - 1 if i + 1 < len(columns) else plot_width) - col - 1
                if len(label) <= room:
                    canvas.put(top + safe_row, x0 + col + 1, label, _STYLES["rate"], only_empty=True)
        self._surface(canvas, top, x0, columns)  # after the markers and labels: only in the cells they left
        axis = top + HEIGHT
        canvas.put(axis, self.gutter - 1, g["corner"] + g["line"] * plot_width, "axis")
        for col in columns:
            canvas.put(axis, x0 + col, g["mark"], "axis")
        for k, (name, labels) in enumerate(self.labels.items()):
            canvas.put(axis + 1 + k, 0, name, "axis")
            for col, label in zip(columns, labels):
                canvas.put(axis + 1 + k, x0 + col - (len(label) - 1) // 2, label)
        legend = ["M max batch", "s safe batch (tokens/s beside it)"]
        if self.longest:
            legend.append("L longest at batch 1")
        if self._surface_drawable():
            legend.append(f"{g['dot']} the fitted surface at the budget")
        wrapped: list[str] = []
        for part in legend:  # whole entries to a line, as many as it holds
            if wrapped and len(wrapped[-1]) + 3 + len(part) <= width:
                wrapped[-1] += "   " + part
            else:
                wrapped.extend(textwrap.wrap(part, width))
        return Chart(canvas.lines() + tuple(((line, "axis"),) for line in wrapped))

    def _surface_drawable(self) -> bool:
        frontier = self.frontier
        return (
            bool(frontier.budget_bytes)
            and frontier.surface is not None
            and (frontier.surface.unit == frontier.budget_counts)
        )

    def _surface(self, canvas: _Canvas, top: int, x0: int, columns: Sequence[int]) -> None:
        """Dots where the fitted surface meets the budget, between the first and last length
        (log2 of the length interpolated between the columns the lengths sit at)."""
        surface, budget = self.frontier.surface, self.frontier.budget_bytes
        if surface is None or not budget or not self._surface_drawable() or len(columns) < 2:
            return
        logs = [math.log2(s) for s in self.lengths]
        for i in range(len(columns) - 1):
            left, right = columns[i], columns[i + 1]
            for col in range(left + 1, right, 2):
                share = (col - left) / (right - left)
                length = 2 ** (logs[i] + share * (logs[i + 1] - logs[i]))
                batch = surface.largest_batch(length + self.frontier.new_tokens, budget)  # generating: the context
                if math.isfinite(batch) and 2**self.low <= batch <= 2**self.high:
                    row = top + self.row_of(batch)
                    if not any(canvas.used[row][max(0, x0 + col - 1) : x0 + col + 2]):  # a space from the marks
                        canvas.put(row, x0 + col, self.glyphs["dot"], _STYLES["surface"])
