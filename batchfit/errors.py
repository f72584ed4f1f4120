"""The exceptions batchfit raises on purpose, the helpers that word exceptions, and their JSON form.

Pure Python (no torch import) so that the search module can raise them too.
A process hop (a job's rank, the sharded estimate's process: `batchfit.worker`) writes its error as
`error_document` and the caller raises `error_from` of it: the same type, with the same fields.
Errors in the user's input are plain ``TypeError`` / ``ValueError`` with a precise
message; the classes here cover the outcomes of a probe itself.
"""

from __future__ import annotations

from typing import Any

from batchfit.units import format_bytes


class BatchfitError(Exception):
    """Base class of every error that batchfit raises about a probe.

    Every one survives ``pickle`` unchanged (message, attributes, notes), because a worker
    process hands its exception to another process that way: Ray Train sends a worker's error to
    the driver pickled, as ``multiprocessing`` does. Python's default rebuilds an exception by
    calling its class with ``self.args`` (the message alone), which fails for an error whose
    ``__init__`` takes its parts ([`RankFailedError`][batchfit.errors.RankFailedError]) and garbles one that formats its
    message from them ([`NothingFitsError`][batchfit.NothingFitsError]); so the copy is rebuilt without ``__init__``.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class NothingFitsError(BatchfitError):
    """Even the smallest batch size that the search may try ran out of memory.

    Attributes:
        batch_size: the size that failed.
        needed_bytes: memory that was live (or requested) when the step failed, a
            lower bound on what that size needs; ``None`` when the backend did not say.
        budget_bytes: the memory budget the probe ran under, if known.
    """

    def __init__(
        self,
        batch_size: int,
        needed_bytes: int | None = None,
        budget_bytes: int | None = None,
        phase: str | None = None,
        cause: str | None = None,
        advice: str | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes
        self.phase = phase
        self.cause = cause
        self.advice = advice
        super().__init__(self._message())

    def _message(self) -> str:
        where = f" in {self.phase}" if self.phase else ""
        msg = f"batch size {self.batch_size} does not fit: it ran out of memory{where}"
        if self.needed_bytes is not None:
            msg += f" needing at least {format_bytes(self.needed_bytes)}"
        if self.budget_bytes is not None:
            msg += f" with a budget of {format_bytes(self.budget_bytes)}"
        msg += ". " + (self.advice or "Lower init_batch, raise memory_limit, or shrink the sample/model.")
        if self.cause:
            msg += f" The error was: {self.cause}"
        return msg


class DeviceFailedError(BatchfitError):
    """The device reported an error that poisons its context (CUDA illegal memory access,
    device-side assert, ...). The probe stops: later trials on that context would lie."""


class UncountableMemoryError(BatchfitError):
    """A step made a tensor whose memory the CPU meter cannot count (an MKL-DNN tensor, a layout
    without storages). The probe stops rather than answer as if that memory were free."""


class LimitError(BatchfitError):
    """A memory limit that cannot be enforced: this process already holds more memory on the
    device than the limit allows, so the allocator's cap would not stop the first trial."""


class NoOptimizerStepError(BatchfitError):
    """The optimizer never stepped in a trial (with fp16, every step's gradients overflowed and
    the ``GradScaler`` skipped ``optimizer.step()``), so the optimizer state was never allocated
    and the trial's memory cannot be trusted."""


class RankFailedError(BatchfitError):
    """Another rank of a distributed probe raised an error that is not an out-of-memory.

    Every rank raises this (the failing rank raises its own exception), so no rank is left
    waiting. Attributes: ``rank`` (the rank that failed), ``batch_size`` (``None`` outside a
    trial), ``phase``, ``error`` (the original exception's type and first line).
    """

    def __init__(self, rank: int, batch_size: int | None, phase: str, error: str) -> None:
        self.rank = rank
        self.batch_size = batch_size
        self.phase = phase
        self.error = error
        where = f"at batch size {batch_size} during {phase}" if batch_size is not None else f"during {phase}"
        super().__init__(f"rank {rank} failed {where}: {error}")


class RanksTimeoutError(BatchfitError):
    """The ranks of a distributed probe did not all reach the same meeting point in time: a rank
    did not call ``find()``, is stuck in the user's code, or died."""


class EstimateTimeoutError(BatchfitError, TimeoutError):
    """A sharded estimate's process gave no answer within its time limit
    ([`estimate_sharded`][batchfit.estimate_sharded]'s ``timeout_s``): it and every process it
    started were killed. Attributes: ``target``, ``timeout_s``, ``output`` (the end of what the
    process wrote to stderr: where it stood)."""

    def __init__(self, target: str, timeout_s: float, output: str = "") -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.output = output
        said = f"; its output ended with:\n{output}" if output.strip() else ""
        super().__init__(
            f"the sharded estimate of {target} gave no answer within timeout_s={timeout_s:g} s, so its process and "
            "every process it started were killed: a target that waits (on a download, a lock, input, a real "
            "process group) hangs there; a model that needs longer takes a larger timeout_s= (None waits without "
            f"limit){said}"
        )


def _rebuild(cls: type[BatchfitError], args: tuple[Any, ...], state: dict[str, Any]) -> BatchfitError:
    """A pickled [`BatchfitError`][batchfit.BatchfitError] as it was: its args, attributes and notes, no
    ``__init__``."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, for a trial record."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def annotate(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` so it shows under its traceback, keeping type and args."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: store it the same way 3.11 does
        notes = list(getattr(exc, "__notes__", []))
        notes.append(note)
        exc.__notes__ = notes  # type: ignore[attr-defined]


def error_document(exc: BaseException) -> dict[str, Any]:
    """What a worker process writes instead of an answer, for its caller to raise again (`error_from`):
    a batchfit error by its class name, with its arguments and fields (those JSON can carry);
    ``TypeError`` / ``ValueError`` (a subclass too) as such; anything else by its type's name."""
    said: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, BatchfitError):
        said["args"] = [_json_value(arg) for arg in exc.args]
        said["fields"] = {name: _json_value(value) for name, value in vars(exc).items()}
    elif isinstance(exc, (TypeError, ValueError)):
        said["type"] = "TypeError" if isinstance(exc, TypeError) else "ValueError"
    return {"error": said}


def error_from(document: dict[str, Any], where: str = "the worker process") -> Exception:
    """The exception `error_document` wrote, as its own type where that is batchfit's, ``TypeError``
    or ``ValueError``; anything else a ``RuntimeError`` that names the type (``where`` raised it)."""
    said = document["error"]
    kind, message = str(said.get("type")), str(said.get("message"))
    errors = {cls.__name__: cls for cls in _subclasses(BatchfitError)}
    if kind in errors and isinstance(said.get("fields"), dict):
        return _rebuild(errors[kind], tuple(said.get("args", [message])), dict(said["fields"]))
    if kind in ("TypeError", "ValueError"):
        return TypeError(message) if kind == "TypeError" else ValueError(message)
    return RuntimeError(f"{where} raised {kind}: {message}")


def _subclasses(cls: type[BatchfitError]) -> list[type[BatchfitError]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found += _subclasses(sub)
    return found


def _json_value(value: Any) -> Any:
    """``value`` where JSON carries it as it is, else its text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    return str(value)
