"""What a person sees while a probe runs: a rich live view on a terminal, plain lines elsewhere.

The probe never prints, and nothing below the front ends imports this package: a probe calls
``on_trial_start(batch_size, kind)`` before a trial and ``callback(trial)`` after it, and a front
end (the CLI, ``batchfit.find(progress=True)``) passes callbacks that feed a view:

* `LiveView` (a terminal): a table that grows by one row per finished trial, a spinner
  line for the trial in flight, then a summary panel. Colours follow ``NO_COLOR``.
* `PlainView` (a pipe, a file, a CI log): one plain line per finished trial as it
  finishes, then the summary as aligned lines. No escape codes, no spinner, nothing that redraws,
  so a CI log reads like the terminal's final frame.
* `QuietView` (``--quiet``): nothing while running, one line at the end.

A frontier (``batchfit frontier``, ``batchfit.frontier(progress=True)``) has its own view,
`FrontierView` (a row per finished length, then the table and the chart of
`frontier_chart`), and `FrontierProgress` is ``frontier(progress=True)``'s.

All three read the same formatted cells (``batchfit.view.cells``), so the numbers cannot differ
between a terminal and a log. `make_view` picks the view for a stream; `Progress`
is ``find(progress=True)``'s.

When the reader of a plain or quiet view goes away (``batchfit probe ... | head -1``), its next
write raises `OutputClosedError`, a ``BrokenPipeError`` of the view's own, so the CLI can
tell it from one raised by the user's model (a data pipe) and stop quietly.

Only the front ends (its own layer) use a view, so this surface exports nothing: they import each
name from its module (`batchfit.view.progress.make_view`).
"""

from batchfit._lazy import lazy_surface

__all__: list[str] = []

#: Names this surface exported before issue 33: the front ends import them from their modules.
#: (`frontier_chart` is a module's name too: `batchfit.view.frontier_chart.frontier_chart`.)
_MOVED = dict.fromkeys(("FrontierProgress", "FrontierView"), "batchfit.view.frontier_view")

__getattr__, _ = lazy_surface(__name__, globals(), {}, _MOVED)
