"""What the CLI writes besides the views: exit codes, the one-line errors, ``--json`` files, the
line shown while a target loads, the plan line, the recommended batch, and what libraries said
during a probe (held back until its table is whole).

Every error goes to stderr in a line starting with ``batchfit: error:`` (see ``batchfit.cli``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import stat
import sys
import tempfile
import traceback
import warnings
from typing import TYPE_CHECKING, Any, TextIO

from batchfit.errors import first_line
from batchfit.estimation import check_target, plan_for
from batchfit.units import format_duration

if TYPE_CHECKING:
    from batchfit.targets import Target

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_DOES_NOT_FIT = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE
EXIT_TERMINATED = 143  # 128 + SIGTERM

#: What an interrupted probe says once it had started: ``Prober`` restores on any exit.
RESTORED = "the model and optimizer were restored"


class UsageError(Exception):
    """Raised inside a subcommand for a usage problem found after argument parsing."""


def error(message: str, stream: TextIO | None = None) -> None:
    try:
        print(f"batchfit: error: {message}", file=stream or sys.stderr)
    except BrokenPipeError:  # stderr's reader is gone too (`2>&1 | head`): no one is left to tell
        pass


def report_exception(exc: BaseException, show_traceback: bool, *, cause: bool, text: str | None = None) -> None:
    """One line for the error (with batchfit's note on where it happened), the traceback only
    when asked: the user's own frames are in it."""
    shown = exc.__cause__ if cause and exc.__cause__ is not None else exc
    if show_traceback:
        traceback.print_exception(shown, file=sys.stderr)
    notes = [n.removeprefix("batchfit: ") for n in getattr(shown, "__notes__", ())]
    if text is None:
        text = str(exc) if cause else first_line(exc)
    if notes:
        text += f" ({'; '.join(notes)})"
    if not show_traceback:
        text += " [--traceback shows where]"
    error(text)


# helpers ------------------------------------------------------------------------------------------
def check_json_path(path: str | None) -> None:
    """Refuse (exit 2) a ``--json PATH`` that cannot be written before anything runs: found out
    after the probe, it would cost the whole probe. Permissions as ``os.access`` sees them (root
    passes); what only the write can find out (a full disk, ``/dev/full``) is reported by
    ``write_json``, which then saves the result elsewhere and says where."""
    if path is None or path == "-":
        return
    folder = os.path.dirname(path) or os.curdir
    if os.path.isdir(path):
        problem = "it is a folder"
    elif not os.path.exists(folder):
        problem = f"its folder {folder!r} does not exist"
    elif not os.path.isdir(folder):
        problem = f"{folder!r} is not a folder"
    elif os.path.exists(path):
        problem = "" if os.access(path, os.W_OK) else "the file is not writable"
    else:
        problem = "" if os.access(folder, os.W_OK | os.X_OK) else f"its folder {folder!r} is not writable"
    if problem:
        raise UsageError(f"cannot write --json {path!r}: {problem}")


def write_json(path: str, text: str) -> None:
    """Write ``--json``'s text: a regular file atomically (a temporary file beside it, then
    ``os.replace``, so a failed write leaves what was there), anything else (``/dev/stdout``, a
    pipe) directly. When the write fails after a probe, the JSON goes to a temporary file of its
    own and the error names it: the result is not lost with the write."""
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    data = (text + "\n").encode("utf-8")
    try:
        real = os.path.realpath(path)  # a link to a file: the file is replaced, the link stays
        if os.path.exists(real) and not os.path.isfile(real):
            _write_to(real, data)  # a special file: it cannot be replaced, only written
        else:
            _replace(real, data)
    except OSError as exc:
        problem = f"cannot write --json {path!r}: {exc.strerror or exc}"
        raise UsageError(f"{problem}; {_save_elsewhere(data)}") from None


def _write_to(path: str, data: bytes) -> None:
    with open(path, "wb") as stream:
        stream.write(data)


def _replace(path: str, data: bytes) -> None:
    """``path`` becomes ``data`` at once: written to a temporary file in its folder, then renamed
    over it. A folder that cannot take a temporary file (a writable file in a read-only folder)
    gets the file written in place."""
    folder = os.path.dirname(path) or os.curdir
    if not os.access(folder, os.W_OK | os.X_OK):
        _write_to(path, data)
        return
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
        # mkstemp's file is private (0600): the result gets the mode the old file had, else the umask's.
        os.chmod(temporary, stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _save_elsewhere(data: bytes) -> str:
    """Save ``data`` to a new temporary file; the words that tell where (or that it could not)."""
    try:
        fd, saved = tempfile.mkstemp(prefix="batchfit-result-", suffix=".json")
    except OSError as exc:
        return f"the result could not be saved elsewhere either ({exc.strerror or exc})"
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(saved)
        return f"the result could not be saved elsewhere either ({exc.strerror or exc})"
    return f"the result was saved to {saved}"


def stdout_to_devnull() -> None:
    """After a broken pipe: what is still buffered for stdout goes nowhere, quietly, at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (replaced, closed): nothing left to flush into a pipe
        pass


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def load(args: argparse.Namespace, lengths: bool | None = None) -> Target | int:
    """The target, or the exit code of why it could not be loaded (said on stderr). Importing a
    model and building it can take seconds: a terminal is told meanwhile, on a line that goes
    away when the target is in. A command given ``--seq-lens`` (or ``lengths=True``) sizes lengths
    with the target's ``make_batch``; the others size its sample (``batchfit.targets``)."""
    from batchfit.targets import TargetCallError, TargetError, load_target  # lazy: torch (--help, devices)

    stream = sys.stderr if getattr(args, "json", None) == "-" else sys.stdout
    waiting = is_terminal(stream) and not getattr(args, "quiet", False)
    if waiting:
        stream.write(f"batchfit: loading {args.target} (importing it, building the model)...")
        stream.flush()
    try:
        if lengths is None:
            lengths = getattr(args, "seq_lens", None) is not None
        return load_target(args.target, lengths=lengths)
    except TargetError as exc:
        error(str(exc))
        return EXIT_USAGE
    except TargetCallError as exc:
        report_exception(exc, args.traceback, cause=True)
        return EXIT_ERROR
    finally:
        if waiting:
            stream.write("\r\x1b[2K")  # the loading line goes; the probe's header takes its place
            stream.flush()


def plan_line(
    result: Any,
    target_batch: int | None = None,
    *,
    target_tokens: int | None = None,
    seq_len: int | None = None,
    world_size: int | None = None,
) -> str:
    """The plan for ``--target-batch`` (or ``--target-tokens``, in sequences of ``--seq-len`` or of the
    length the result was sized on) on ``--world-size`` ranks (default the probe's), or why there is
    none (a target the ranks cannot share, tokens without a known length)."""
    try:
        plan = plan_for(result, target_batch, world_size, target_tokens=target_tokens, seq_len=seq_len)
        return f"plan             {plan.summary()}"
    except ValueError as exc:
        return f"plan             none: {exc}"


def check_plan_options(args: Any) -> None:
    """``--target-batch`` or ``--target-tokens`` (with ``--seq-len``, the length sized on), checked
    before the probe rather than after it."""
    if args.target_batch is None and args.target_tokens is None:
        return
    if args.target_batch is not None and args.target_tokens is not None:
        raise UsageError("give --target-batch (samples) or --target-tokens (tokens per step), not both")
    try:
        check_target(args.target_batch, target_tokens=args.target_tokens, seq_len=args.seq_len)
    except ValueError as exc:
        raise UsageError(str(exc).replace("target_tokens", "--target-tokens").replace("seq_len", "--seq-len")) from None


def check_noise_options(args: Any) -> None:
    """``--noise-scale`` and ``--noise-passes``, checked before anything loads: the noise scale is
    measured by a full probe of this process (or of each rank under ``torchrun``)."""
    if getattr(args, "noise_passes", None) is not None and not args.noise_scale:
        raise UsageError("--noise-passes goes with --noise-scale")
    if not args.noise_scale:
        return
    if args.require_batch is not None:
        raise UsageError("--require-batch runs a gate, not a full probe: drop --noise-scale")
    if args.nproc_per_trial is not None:
        raise UsageError("--nproc-per-trial runs every trial as a fresh job: --noise-scale needs the model here")


def noise_source_problem(target: Target) -> str | None:
    """Why ``target`` cannot give the noise scale, or ``None``: it is measured from the spread of
    gradients over many real batches, so the sample must hand out batches (a ``DataLoader``, any
    iterable of batches); one batch repeated would measure no noise at all."""
    from batchfit.probe import is_batch_source  # lazy: torch (--help, devices)

    if is_batch_source(target.sample):
        return None
    given = "no sample (a make_batch)" if target.sample is None else f"one batch (a {type(target.sample).__name__})"
    return (
        f"--noise-scale measures the gradient noise scale from real batches, but {target.spec} gives {given}: "
        "return a DataLoader (or another iterable of batches) as its sample"
    )


def recommendation_lines(
    result: Any,
    target_batch: int | None = None,
    *,
    target_tokens: int | None = None,
    seq_len: int | None = None,
    world_size: int | None = None,
    uneven: bool = False,
) -> list[str]:
    """The last lines of a probe: the noise scale when it was measured, then the batch to train
    with (``Result.recommend``: with ``--target-batch`` / ``--target-tokens`` it reaches that
    target, on ``--world-size`` ranks when given; with ``--uneven`` split over the ranks by what
    each fits), its reason and caveats; or why there is none (tokens without a known length)."""
    lines: list[str] = []
    noise = getattr(result, "noise_scale", None)
    if noise is not None:
        lines.append(f"{'noise scale':<17}{noise_summary(noise)}")
    try:
        recommendation = result.recommend(
            target_batch=target_batch,
            target_tokens=target_tokens,
            seq_len=seq_len,
            world_size=world_size,
            uneven=uneven,
        )
    except ValueError as exc:
        return [*lines, f"{'recommended':<17}none: {exc}"]
    return [*lines, *recommendation.lines()]


def noise_summary(noise: Any) -> str:
    """``~190 samples (90% 150-240), from batches 8 and 64: 128 passes in 12.3 s``."""
    value = "large: the signal drowned in its noise" if noise.b_simple is None else f"~{noise.plain(noise.b_simple)}"
    text = (
        f"{value} samples ({noise.interval_text()}), from batches {noise.small_batch} and {noise.big_batch}: "
        f"{noise.passes} passes in {format_duration(noise.elapsed_s)}"
    )
    return text + "".join(f"; {note}" for note in noise.notes)


# What libraries say during a probe ----------------------------------------------------------------
class HeldOutput:
    """What the model's libraries say while a probe runs, held back and shown once after it.

    A Hugging Face model warns in its forward, once per trial: on a terminal those lines land
    between the table's rows, or on its spinner line. Held here: Python warnings (each once per
    place, as Python's default filter shows them; filters that ignore or raise act as before), and
    log records on their way to the terminal (a handler writing to stdout or stderr, the last-resort
    handler included) from loggers other than batchfit's. Records bound for files pass as before.
    A context manager; `show` then writes each message once, with how often it came.
    """

    def __init__(self) -> None:
        self.said: dict[str, int] = {}
        self._recording = warnings.catch_warnings(record=True)
        self._caught: list[warnings.WarningMessage] | None = []
        self._handlers: list[logging.Handler] = []
        self._last: logging.LogRecord | None = None  # one record passes every handler: counted once

    def __enter__(self) -> HeldOutput:
        self._caught = self._recording.__enter__()  # the list the warnings go to (record=True)
        self._handlers = terminal_handlers()
        for handler in self._handlers:
            handler.addFilter(self._hold)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handler in self._handlers:
            handler.removeFilter(self._hold)
        self._recording.__exit__(*exc_info)  # type: ignore[arg-type]
        caught: dict[str, int] = {}
        for w in self._caught or ():
            text = f"{w.category.__name__}: {w.message} ({os.path.basename(w.filename)}:{w.lineno})"
            caught[text] = caught.get(text, 0) + 1
        self.said = {**caught, **self.said}

    def _hold(self, record: logging.LogRecord) -> bool:
        if record.name == "batchfit" or record.name.startswith("batchfit."):
            return True  # batchfit's own lines are part of what it shows
        if record is not self._last:
            self._last = record
            text = f"{record.name} {record.levelname.lower()}: {record.getMessage()}"
            self.said[text] = self.said.get(text, 0) + 1
        return False

    def show(self, stream: TextIO) -> None:
        """The messages held, each once, under one line that says why they come now."""
        if not self.said:
            return
        lines = ["batchfit: said during the probe (held back so the table stays whole; each once):"]
        lines += [f"  {text}" + (f" ({count} times)" if count > 1 else "") for text, count in self.said.items()]
        try:
            sys.stdout.flush()  # what the probe printed comes first, in a pipe too
            stream.write("\n".join(lines) + "\n")
            stream.flush()
        except BrokenPipeError:  # its reader is gone: nothing left to tell
            pass


def terminal_handlers() -> list[logging.Handler]:
    """Every logging handler that writes to this process's stdout or stderr now."""
    streams = {id(stream) for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    loggers = [logging.getLogger(), *list(logging.Logger.manager.loggerDict.values())]  # a copy: threads add loggers
    found: dict[int, logging.Handler] = {}
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):  # a PlaceHolder has none
            if isinstance(handler, logging.StreamHandler) and id(getattr(handler, "stream", None)) in streams:
                found[id(handler)] = handler
    if logging.lastResort is not None:
        found[id(logging.lastResort)] = logging.lastResort
    return list(found.values())
