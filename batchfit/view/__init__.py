"""What a person sees while a probe runs: a rich live view on a terminal, plain lines elsewhere.

The probe never prints, and nothing below the front ends imports this package: a probe calls
``on_trial_start(batch_size, kind)`` before a trial and ``callback(trial)`` after it, and a front
end (the CLI, ``batchfit.find(progress=True)``) passes callbacks that feed a view:

* :class:`LiveView` (a terminal): a table that grows by one row per finished trial, a spinner
  line for the trial in flight, then a summary panel. Colours follow ``NO_COLOR``.
* :class:`PlainView` (a pipe, a file, a CI log): one plain line per finished trial as it
  finishes, then the summary as aligned lines. No escape codes, no spinner, nothing that redraws,
  so a CI log reads like the terminal's final frame.
* :class:`QuietView` (``--quiet``): nothing while running, one line at the end.

A frontier (``batchfit frontier``, ``batchfit.frontier(progress=True)``) has its own view,
:class:`FrontierView` (a row per finished length, then the table and the chart of
:func:`frontier_chart`), and :class:`FrontierProgress` is ``frontier(progress=True)``'s.

All three read the same formatted cells (``batchfit.view.cells``), so the numbers cannot differ
between a terminal and a log. :func:`make_view` picks the view for a stream; :class:`Progress`
is ``find(progress=True)``'s.

When the reader of a plain or quiet view goes away (``batchfit probe ... | head -1``), its next
write raises :class:`OutputClosedError`, a ``BrokenPipeError`` of the view's own, so the CLI can
tell it from one raised by the user's model (a data pipe) and stop quietly.
"""


from batchfit.view.cells import (
    BAR_WIDTH,
    TrialCells,
    ascii_bar,
    device_label,
    gate_rows,
    memory_equation,
    quiet_line,
    summary_rows,
    trial_cells,
)
from batchfit.view.frontier_chart import Chart, chart_text, frontier_chart
from batchfit.view.frontier_view import FrontierProgress, FrontierView
from batchfit.view.live import WIDE_COLUMNS, LiveView
from batchfit.view.plain import OutputClosedError, PlainView, QuietView, View, fit_lines
from batchfit.view.progress import Progress, columns, make_view, no_color

__all__ = [
    "BAR_WIDTH",
    "Chart",
    "FrontierProgress",
    "FrontierView",
    "WIDE_COLUMNS",
    "LiveView",
    "OutputClosedError",
    "PlainView",
    "Progress",
    "QuietView",
    "TrialCells",
    "View",
    "ascii_bar",
    "chart_text",
    "columns",
    "device_label",
    "fit_lines",
    "frontier_chart",
    "gate_rows",
    "make_view",
    "memory_equation",
    "no_color",
    "quiet_line",
    "summary_rows",
    "trial_cells",
]
