"""Ctrl-C that is never lost, and never lands half-way through a restore.

Python runs a SIGINT handler between bytecodes, wherever the main thread is. Two places in a
probe must not be interrupted there:

* the CPU meter's ``weakref.finalize`` callbacks, which release a dead storage's bytes: an
  exception raised inside a finalizer is printed as "Exception ignored" and dropped, so the
  Ctrl-C would be swallowed and the meter would go on counting phantom bytes;
* the restore of the user's model, which must finish once it has started.

So for the lifetime of a probe :class:`InterruptGuard` replaces Python's default SIGINT handler
with one that only records the interrupt, and the probe raises ``KeyboardInterrupt`` itself at
safe points: after each operation the CPU meter observes, between the phases and steps of a
trial, between trials, and, at the latest, once the restore has finished. A second Ctrl-C during
the restore is recorded the same way and surfaces after it.

A second Ctrl-C *before* the first reached a safe point (user code stuck in Python with no tensor
operation, e.g. waiting on a queue) raises at once, as a second press conventionally does. If it
lands inside a finalizer and is dropped there, the recorded one still surfaces at the next safe
point: it is not cleared until it has been raised from :meth:`InterruptGuard.check` or on exit.

The guard only takes over where Python's default handler is in place and only in the main
thread (signal handlers can only be set there, and only the main thread receives
``KeyboardInterrupt``). A program that installed its own SIGINT handler keeps it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType


class InterruptGuard:
    """Defers SIGINT to :meth:`check` points while active (see the module docs)."""

    def __init__(self) -> None:
        self.pending = False
        #: Set for a probe over several ranks: :meth:`check` never raises, and the ranks raise
        #: together at their next meeting point (:meth:`take` hands the flag to it), so no rank
        #: leaves while the others wait for it (``batchfit.distributed.ranks``).
        self.deferred = False
        self._installed = False
        self._critical = 0

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            signal.signal(signal.SIGINT, self._record)
            self._installed = True
        return self

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.pending and not self._critical:
            raise KeyboardInterrupt  # the second press: the first never reached a safe point
        self.pending = True

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """Code that must finish (the restore): every Ctrl-C inside is only recorded."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1

    def take(self) -> bool:
        """Whether a Ctrl-C arrived since the last check, clearing it: the caller raises."""
        pending, self.pending = self.pending, False
        return pending

    def check(self) -> None:
        """Raise the ``KeyboardInterrupt`` that arrived since the last check, if one did
        (unless :attr:`deferred`: then the ranks' next meeting point raises it)."""
        if self.pending and not self.deferred:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Put Python's handler back; then a recorded interrupt surfaces, unless one already is."""
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._installed = False
        if self.pending and not isinstance(exc, KeyboardInterrupt):
            self.pending = False
            raise KeyboardInterrupt from exc
