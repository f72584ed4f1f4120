"""Ctrl-C that is never lost, and never lands half-way through a restore.

Python runs a SIGINT handler between bytecodes, wherever the main thread is. Two places in a
probe must not be interrupted there:

* the CPU meter's ``weakref.finalize`` callbacks, which release a dead storage's bytes: an
  exception raised inside a finalizer is printed as "Exception ignored" and dropped, so the
  Ctrl-C would be swallowed and the meter would go on counting phantom bytes;
* the restore of the user's model, which must finish once it has started.

So for the lifetime of a probe `InterruptGuard` replaces Python's default SIGINT handler
with one that only records the interrupt, and the probe raises ``KeyboardInterrupt`` itself at
safe points: after each operation the CPU meter observes, between the phases and steps of a
trial, between trials, and, at the latest, once the restore has finished. A second Ctrl-C during
the restore is recorded the same way and surfaces after it.

A second Ctrl-C *before* the first reached a safe point (user code stuck in Python with no tensor
operation, e.g. waiting on a queue) raises at once, as a second press conventionally does. If it
lands inside a finalizer and is dropped there, the recorded one still surfaces at the next safe
point: it is not cleared until it has been raised from `InterruptGuard.check` or on exit.

The guard only takes over where Python's default handler (or another guard's) is in place and
only in the main thread (signal handlers can only be set there, and only the main thread receives
``KeyboardInterrupt``). A program that installed its own SIGINT handler keeps it. A guard entered
inside another takes over until it finishes, then puts the outer one's handler back (a checkpointing
policy's guard around a probe's: `batchfit.probe.checkpointing_blocks.applied`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import CodeType, FrameType, TracebackType
from typing import Any


class InterruptGuard:
    """Defers SIGINT to `check` points while active (see the module docs)."""

    def __init__(self, exits: Iterable[Callable[..., Any]] = ()) -> None:
        """``exits``: the owner's own way out (a probe's ``__exit__``), as uninterruptible as the
        guard's: a Ctrl-C landing there on its way to `finish` is only recorded."""
        self.pending = False
        self._exit_code = _EXIT_CODE | {fn.__code__ for fn in exits}
        #: Set for a probe over several ranks: `check` never raises, and the ranks raise
        #: together at their next meeting point (`take` hands the flag to it), so no rank
        #: leaves while the others wait for it (``batchfit.distributed.ranks``).
        self.deferred = False
        self._installed = False
        self._critical = 0
        #: The handler put back on the way out: Python's, or the guard's this one was entered inside.
        self._outer: Any = signal.default_int_handler

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is threading.main_thread():
            handler = signal.getsignal(signal.SIGINT)
            if handler is signal.default_int_handler or installed_guard() is not None:
                self._outer = handler
                signal.signal(signal.SIGINT, self._record)
                self._installed = True
        return self

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.pending and not self._critical and not _in_exit(frame, self._exit_code):
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
        (unless `deferred`: then the ranks' next meeting point raises it)."""
        if self.pending and not self.deferred:
            self.pending = False
            raise KeyboardInterrupt

    def finish(self, undo: Callable[[], None], exc: BaseException | None = None) -> None:
        """Run ``undo`` (the restore) to its end and put Python's handler back, as one critical
        section; then let a Ctrl-C that arrived meanwhile surface, unless one already is (``exc``).

        One section, not a critical one followed by the guard's exit: a second Ctrl-C landing
        between the two would raise from this guard's handler before Python's was put back, and
        the handler would stay installed for the rest of the process. The handler also records
        without raising while it finds itself in this code (`_in_exit`), so a Ctrl-C landing
        before the section's counter has moved cannot cut the restore short either."""
        self._critical += 1
        try:
            undo()
        finally:
            try:
                if self._installed:
                    self._installed = False
                    if signal.getsignal(signal.SIGINT) == self._record:  # not when a guard inside is still on
                        outer = getattr(self._outer, "__self__", None)
                        gone = isinstance(outer, InterruptGuard) and not outer._installed
                        signal.signal(signal.SIGINT, signal.default_int_handler if gone else self._outer)
            finally:
                self._critical -= 1
            if self.pending and not isinstance(exc, KeyboardInterrupt):
                self.pending = False
                raise KeyboardInterrupt from exc

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Put Python's handler back; then a recorded interrupt surfaces, unless one already is."""
        self.finish(_nothing, exc)


def _nothing() -> None:
    """An undo with nothing to undo."""


def installed_guard() -> InterruptGuard | None:
    """The guard whose handler receives SIGINT in this thread now (the main thread's), if one does."""
    if threading.current_thread() is not threading.main_thread():
        return None
    owner = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
    return owner if isinstance(owner, InterruptGuard) else None


def critical_section() -> contextlib.AbstractContextManager[None]:
    """The installed guard's critical section (a Ctrl-C inside is only recorded), or nothing where no
    guard is installed: for code that must finish whether or not it runs inside a probe."""
    guard = installed_guard()
    return contextlib.nullcontext() if guard is None else guard.critical()


def _in_exit(frame: FrameType | None, codes: frozenset[CodeType], depth: int = 4) -> bool:
    """Whether the interrupted code is the guard's own way out (`InterruptGuard.finish`,
    `critical`, ``__exit__``): there a Ctrl-C is only recorded, whatever
    bytecode it lands on. A few frames up, to cover the calls between them."""
    while frame is not None and depth > 0:
        if frame.f_code in codes:
            return True
        frame, depth = frame.f_back, depth - 1
    return False


#: The code of the guard's way out (see `_in_exit`).
_EXIT_CODE = frozenset(
    {
        InterruptGuard.finish.__code__,
        InterruptGuard.__exit__.__code__,
        InterruptGuard.critical.__wrapped__.__code__,  # type: ignore[attr-defined]
    }
)
