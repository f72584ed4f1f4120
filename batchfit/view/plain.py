"""Plain lines for pipes and CI logs, and ``--quiet``'s one line; the protocol every view follows."""

from __future__ import annotations

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
