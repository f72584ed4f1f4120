"""Which view a stream gets, and ``find(progress=True)``'s view fed by the probe's callbacks."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from batchfit.view.live import LiveView
from batchfit.view.plain import PlainView, QuietView, View

if TYPE_CHECKING:
    from batchfit.report import Result, Trial


def make_view(stream: TextIO, *, quiet: bool = False, plain: bool | None = None) -> View:
    """The view for ``stream``: live on an interactive terminal, plain lines anywhere else.

    ``plain=None`` decides from the stream: not a TTY, or ``TERM=dumb``, means plain. A plain
    view keeps its lines within ``COLUMNS`` when it is set (`columns`); the live view's
    console reads ``COLUMNS`` itself. ``--quiet``'s one line stays one line.
    """
    if quiet:
        return QuietView(stream)
    if plain is None:
        plain = not _is_tty(stream) or os.environ.get("TERM") == "dumb"
    if plain:
        return PlainView(stream, width=columns())
    return LiveView(stream, no_color=no_color())


def columns() -> int | None:
    """``COLUMNS`` when it is set to a positive whole number: the width plain lines keep within
    (piped output has no terminal to ask). ``None`` otherwise: lines as wide as their cells."""
    value = os.environ.get("COLUMNS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def no_color() -> bool:
    """https://no-color.org: any non-empty ``NO_COLOR`` turns colour off."""
    return os.environ.get("NO_COLOR", "") != ""


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed stream
        return False


def then(own: Callable[..., None], user: Callable[..., Any] | None) -> Callable[..., None]:
    """A callback that feeds the view (``own``), then calls the user's own, if any, with the same
    arguments: a front end's view never takes a caller's callback away."""
    if user is None:
        return own

    def both(*args: Any) -> None:
        own(*args)
        user(*args)

    return both


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

        return {
            "callback": then(self.view.trial_finished, callback),
            "on_trial_start": then(self.view.trial_started, on_trial_start),
            "on_start": started,
        }

    def summary(self, result: Result) -> None:
        if self._started:
            self.view.stop()
            self._started = False
        self.view.summary(result)
