"""Plain lines for pipes and CI logs, and ``--quiet``'s one line; the protocol every view follows.

A plain view given a ``width`` (``COLUMNS``, see `batchfit.view.make_view`) keeps every line
within it: narrower than a full trial row, the rows drop the bar of the budget (its share stays) and
close up; a line still too long is broken at spaces and continues indented. Without a width the
lines are as wide as their cells.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TextIO

from batchfit.view.cells import BAR_WIDTH, ascii_bar, gate_rows, quiet_line, summary_rows, trial_cells

if TYPE_CHECKING:
    from batchfit.report import Result, Trial
    from batchfit.testing import GateReport


class OutputClosedError(BrokenPipeError):
    """The stream a view writes to was closed by its reader (``| head``)."""


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


def fit_lines(text: str, width: int | None, indent: int = 4) -> list[str]:
    """``text`` as lines of at most ``width`` characters: broken at spaces (a word longer than a
    line is cut), each continuation indented by ``indent`` (less where the width is too small
    for it). Whole when ``width`` is ``None`` or the text fits."""
    if width is None or len(text) <= width:
        return [text]
    if indent > width // 2:
        indent = min(4, width // 2)
    return textwrap.wrap(text, width, subsequent_indent=" " * indent, break_on_hyphens=False) or [""]


def write_fitted(out: TextIO, text: str, width: int | None, indent: int = 4) -> None:
    """``text`` written to ``out`` in lines that fit ``width`` (`fit_lines`), flushed; a
    reader that went away is an `OutputClosedError`."""
    try:
        for line in fit_lines(text, width, indent):
            out.write(line + "\n")
        out.flush()
    except BrokenPipeError as exc:
        raise OutputClosedError(exc.errno, exc.strerror) from None


class PlainView:
    """Plain lines for pipes and CI logs (see module docs)."""

    _COLUMNS = ("#", "batch", "kind", "outcome", "peak", "", "step", "samples/s")

    def __init__(self, stream: TextIO, width: int | None = None) -> None:
        self._out = stream
        self._width = width
        self._budget: int | None = None
        self._count = 0
        self._header_printed = False
        # The bar of the budget goes when a full row would not fit (the share says the same).
        self._bar = width is None or width >= len(self._format(self._COLUMNS, bar="of budget".ljust(BAR_WIDTH + 2)))

    def _line(self, text: str = "", indent: int = 4) -> None:
        write_fitted(self._out, text, self._width, indent)

    def start(self, header: Sequence[str], budget_bytes: int | None) -> None:
        self._budget = budget_bytes
        for line in header:
            self._line(line, indent=2)

    def set_budget(self, budget_bytes: int | None) -> None:
        self._budget = budget_bytes

    def trial_started(self, batch_size: int, kind: str) -> None:
        """Nothing: a CI log gets one line per trial, when it has an outcome."""

    def trial_finished(self, trial: Trial) -> None:
        if not self._header_printed:
            if self._bar:
                self._line(self._format(self._COLUMNS, bar="of budget".ljust(BAR_WIDTH + 2)))
            else:
                self._line(self._narrow(("#", "batch", "kind", "outcome", "peak", "budget", "step", "samples/s")))
            self._header_printed = True
        self._count += 1
        cells = trial_cells(self._count, trial, self._budget)
        row = (cells.index, cells.batch, cells.kind, cells.outcome, cells.peak, cells.share, cells.step, cells.rate)
        if self._bar:
            self._line(self._format(row, bar=ascii_bar(cells.fraction).ljust(BAR_WIDTH + 2)))
        else:
            self._line(self._narrow(row))

    @staticmethod
    def _format(cells: Sequence[str], bar: str) -> str:
        i, batch, kind, outcome, peak, share, step, rate = cells
        return (
            f"{i:>3}  {batch:>7}  {kind:<6}  {outcome:<16}  {peak:>13}  {bar} {share:>5}  {step:>10}  {rate:>11}"
        ).rstrip()

    @staticmethod
    def _narrow(cells: Sequence[str]) -> str:
        """A row without the bar, closed up: 79 columns."""
        i, batch, kind, outcome, peak, share, step, rate = cells
        return f"{i:>3} {batch:>7} {kind:<6} {outcome:<16} {peak:>13} {share:>6} {step:>10} {rate:>11}".rstrip()

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
            self._line(f"{label:<{width}}  {value}".rstrip(), indent=width + 2)  # continued under the value


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
