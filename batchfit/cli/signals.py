"""SIGTERM during a probe unwinds as Ctrl-C does: the model restored, the live view taken down."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class Terminated(KeyboardInterrupt):
    """SIGTERM during a probe. A ``KeyboardInterrupt`` so that it unwinds exactly as Ctrl-C does:
    past the user's ``except Exception``, through the probe's restore, to the CLI, which takes the
    view down. ``forced``: raised at once by a second SIGTERM, wherever the probe stood."""

    def __init__(self, *, forced: bool = False) -> None:
        super().__init__()
        self.forced = forced


class SigtermUnwinds:
    """While a probe runs, SIGTERM is delivered as a Ctrl-C instead of killing the process where
    it stands, so the probe unwinds as on Ctrl-C: the model restored, the live view stopped (a
    terminal gets its cursor back); `received` then turns exit 130 into 143. Around the
    probe only: outside it SIGTERM keeps its default. Off the main thread (``main()`` called from
    a thread) no handler can be set and nothing changes.

    Delivered as a Ctrl-C means: handed to the SIGINT handler in place. During a probe that is
    ``batchfit.interrupts``' guard, which defers it to the probe's next safe point (never inside
    a meter finalizer, where it would be lost, nor half-way through the restore); where Python's
    own handler is in place, `Terminated` is raised at once, as Python raises Ctrl-C.
    A probe stuck in the user's code where no safe point comes (a forward waiting on a queue,
    with no tensor operation) would then never stop, as it would not on Ctrl-C; so a second
    SIGTERM raises at once, wherever the probe stands (the restore may be cut short: the message
    says so). Once a SIGTERM has come, later ones are ignored after the probe (``SIG_IGN``, which
    Python keeps through its shutdown where it resets its own handlers): a supervisor repeating
    SIGTERM cannot kill batchfit half-way through saying why it stopped, and the exit code stays
    143.
    """

    def __init__(self) -> None:
        self.received = False
        self._holding = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> SigtermUnwinds:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        again, self.received = self.received, True
        if self._holding:
            return
        if again:
            raise Terminated(forced=True)
        on_interrupt = signal.getsignal(signal.SIGINT)
        if callable(on_interrupt) and on_interrupt is not signal.default_int_handler:
            on_interrupt(signal.SIGINT, frame)
        else:
            raise Terminated()

    def hold(self) -> None:
        """From here on a SIGTERM is only recorded: the clean-up that follows runs to its end."""
        self._holding = True

    def __exit__(self, *exc_info: object) -> None:
        self._holding = True
        if not self._installed:
            return
        if self.received:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
