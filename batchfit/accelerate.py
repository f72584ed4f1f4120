"""A drop-in for Accelerate's ``find_executable_batch_size`` that finds the exact boundary.

Accelerate's decorator (``accelerate.utils.find_executable_batch_size``) calls the user's training
function at ``starting_batch_size`` and, after each out-of-memory, again at 90% of the size. It
returns the first run that completes. So it never looks upward, it lands up to ~10% (and one
rounding step) below the boundary, and every OOM restarts the whole function (accelerate #1934).
This decorator calls the function the same way but chooses the sizes with batchfit's search.

**Why a** ``probe`` **argument.** The decorated function is the *whole* training run: a call at a
size that fits runs to completion. That is how Accelerate's decorator works too (the first
success is the answer). Searching upward means calling the function at sizes that fit and then
at bigger ones, which would finish training several times. That is unacceptable for real
training, and from outside a function nothing can stop it after "a few steps". So the
function has to say how to try a size cheaply:

* **With** ``probe`` (the function has a parameter of that name): every try is a call with
  ``probe=True``, and the function should run only a few steps (two or more, so optimizer
  state exists, and with the same loaders, model and step as the real run) and return. The
  wrapper grows from ``starting_batch_size`` (doubling) and bisects to the exact largest size
  that fits (or searches down when ``starting_batch_size`` already fails). Then it makes
  **one** real call with ``probe=False`` and returns that call's result.
  The real call uses the largest fit less a ``margin``, a fraction of its samples, by default none: the exact
  boundary, as the decorator this replaces means "the largest size that runs". The probe saw a
  few steps at one shape; the real run goes on for hours and may meet what the probe never did
  (evaluation, longer or variable-length batches, fragmentation), so ``margin=0.1`` leaves a
  margin, counted in samples, not bytes (an opaque function gives no memory figures; memory is
  roughly fixed + per-sample, so 10% fewer samples frees a little less than 10% of it). When
  every size up to ``max_batch_size`` fitted, no margin is taken: the cap, not memory, decided.
  If the real call still runs out of memory, it is retried lower by ``max(margin, 10%)`` each
  time (Accelerate's semantics, logged as a warning).
* **Without** ``probe``: Accelerate's semantics exactly. The first call is at
  ``starting_batch_size``, the first size that completes is the answer (so a start below the
  boundary returns at once), and after an OOM the next size is 10% smaller (Accelerate's 0.9
  step), never below 1 (or ``multiple_of``). Halving would need fewer restarts but could land
  just over half the boundary, lower than Accelerate's answer: a drop-in must not do worse. No
  search that ends at its first success can be exact: accept ``probe`` for the exact size.

Non-OOM exceptions (a shape error, a sticky CUDA error, a ``KeyboardInterrupt``) propagate
unchanged at once: an error that is not a memory error is never taken for "too big". OOMs are
recognised by `batchfit.backends.oom.is_oom`. Between tries the wrapper drops the failed call's
traceback, whose frames hold the step's tensors, runs ``gc.collect()`` and empties the device's
cache through `batchfit.backends` (only on an accelerator this process has initialised), so
every try starts from the same memory and cycles cannot carry one try's tensors into the next. The
full collection costs ~0.1 s per try in a big process, which is small next to building a model.

**Differences from Accelerate's decorator** (the signature
``find_executable_batch_size(function=None, starting_batch_size=128, reduce_batch_size_fn=None)``
is the same, and the function still gets ``batch_size`` as its first positional argument):

* The keywords ``max_batch_size`` (32768), ``multiple_of`` (1) and ``margin`` (0; ``headroom=``, which warns) are extra.
  ``starting_batch_size`` must be a multiple of ``multiple_of`` and at most ``max_batch_size``.
* ``reduce_batch_size_fn`` (no arguments, returns the next size) is used only without
  ``probe``, in place of the 10% step down. With ``probe`` the search picks every size, so it is not
  called, and a warning says so. A size it returns that is not below the failed one is an error
  (Accelerate would loop forever).
* Accelerate remembers the reduced size across calls of the decorated function. Here each
  call searches again from ``starting_batch_size``, because memory may have changed since.
* When nothing fits, Accelerate raises ``RuntimeError("No executable batch size found, reached
  zero.")``. This raises `NoExecutableBatchSizeError`, a `RuntimeError` *and* a
  [`batchfit.NothingFitsError`][batchfit.NothingFitsError], with the last OOM as its cause.
* Accelerate's list of OOM messages includes Habana's ``PT_DEVMEM Allocation failed``, which
  `batchfit.backends.oom.is_oom` does not know yet.
* The size used and the tries are logged on the ``"batchfit"`` logger and kept on the wrapper:
  ``.batch_size`` (the size of the call whose result was returned), ``.largest_fit`` (the
  exact boundary, with ``probe`` only) and ``.trials`` (``(size, fits)`` for every call in
  order, probes and real calls alike).
* Accelerate is not imported: this module works without it installed.

The probes use fresh random draws, so with ``probe`` the real run's randomness differs from an
undecorated run's unless the function seeds itself, as Accelerate's own example does.

**Evaluation** is sized the same way, by a decorated evaluation function of its own (with
``probe``: a few batches under ``torch.no_grad()``, then return), because its batch is not
training's: no gradients and no activations kept for backward, so a larger one fits. Call it
first where the run evaluates, after the optimizer has stepped: evaluation must fit beside the
training state then live (the optimizer's moments), and that is what the probes then run beside.
Each call searches again, so later evaluations call ``evaluate.__wrapped__(evaluate.batch_size)``.
With a model and a batch in hand, ``batchfit.find(model, batch, eval=True)`` sizes both steps in
one call (``result.eval_safe_batch``), with no search by restarts.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, NoReturn, TypeVar, overload

import torch

from batchfit.backends import backend_for, default_device, is_oom
from batchfit.backends.select import is_host
from batchfit.errors import NothingFitsError, first_line
from batchfit.probe import DEFAULT_MAX_BATCH
from batchfit.probe.options import renamed
from batchfit.search import Bracket, Doubling, Grid, search
from batchfit.search.core import midpoint

__all__ = ["ExecutableBatchSize", "NoExecutableBatchSizeError", "find_executable_batch_size"]

logger = logging.getLogger("batchfit")

T = TypeVar("T")

#: The keyword that tells the function whether a call is a probe (a few steps) or the real run.
PROBE = "probe"
#: The smallest step down after the real call itself ran out of memory (Accelerate's 10%).
REAL_CALL_STEP = 0.1


class NoExecutableBatchSizeError(NothingFitsError, RuntimeError):
    """Even the smallest size ran out of memory. It is a ``RuntimeError``, as Accelerate's
    error is, so code that catches Accelerate's error catches this one too."""


@dataclass(frozen=True)
class _Verdict:
    """What the search's oracle answers: an opaque function gives no memory figures."""

    fits: bool
    peak_bytes: int | None = None


class _Below(Doubling):
    """Bisection below a size already known to fail.

    The search only knows the failures it asked about itself, so after a downward phase it
    would double again toward the known failure, costing a probe. This strategy bisects
    toward the known failure instead.
    """

    def __init__(self, failed: int) -> None:
        self.failed = failed

    def propose(self, bracket: Bracket) -> int:
        high = self.failed if bracket.high is None else bracket.high
        return midpoint(bracket.low, high, bracket.grid)


class ExecutableBatchSize(Generic[T]):
    """The decorated function: call it with the function's arguments after ``batch_size``.

    After a call, ``batch_size`` is the size whose result was returned, ``largest_fit`` is the
    exact largest size that fitted (found only with ``probe``, else ``None``), and ``trials``
    holds ``(size, fits)`` for every call of the function in order.
    """

    def __init__(
        self,
        function: Callable[..., T],
        starting_batch_size: int,
        reduce_batch_size_fn: Callable[[], int] | None,
        max_batch_size: int,
        multiple_of: int,
        margin: float,
    ) -> None:
        for name, value in (
            ("starting_batch_size", starting_batch_size),
            ("max_batch_size", max_batch_size),
            ("multiple_of", multiple_of),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if starting_batch_size % multiple_of:
            raise ValueError(f"starting_batch_size={starting_batch_size} must be a multiple of {multiple_of=}")
        if max_batch_size < starting_batch_size:
            raise ValueError(f"max_batch_size={max_batch_size} is below starting_batch_size={starting_batch_size}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"margin must be a fraction in [0, 1) of the samples, got {margin!r}")
        if reduce_batch_size_fn is not None and not callable(reduce_batch_size_fn):
            raise TypeError("reduce_batch_size_fn must be a callable that takes no arguments")
        functools.update_wrapper(self, function)
        self.function = function
        self.grid = Grid(starting_batch_size, max_batch_size, multiple_of)
        self.reduce_batch_size_fn = reduce_batch_size_fn
        self.margin = float(margin)
        self.takes_probe, self._positional = _inspect(function)
        self.batch_size: int | None = None
        self.largest_fit: int | None = None
        self.trials: list[tuple[int, bool]] = []
        #: The last OOM (traceback dropped): the cause of a `NoExecutableBatchSizeError`.
        self._last_oom: BaseException | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> T:
        name = getattr(self.function, "__name__", "function")
        if self._positional is not None and len(args) + 1 > self._positional:
            raise TypeError(
                f"batch size was passed into `{name}` as its first argument when called; the decorator "
                f"passes it: call `{name}` with the arguments that follow batch_size only"
            )
        if self.takes_probe and PROBE in kwargs:
            raise TypeError(f"`{PROBE}` is passed by the decorator; do not pass it to `{name}`")
        self.batch_size, self.largest_fit, self.trials, self._last_oom = None, None, [], None
        _free_memory()
        if self.takes_probe:
            return self._probe_then_train(args, kwargs)
        return self._first_success(args, kwargs)

    # the two modes ---------------------------------------------------------------------------------
    def _probe_then_train(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        """Probe for the exact boundary, then make the real call below it (see module docs)."""
        if self.reduce_batch_size_fn is not None:
            logger.warning("batchfit: reduce_batch_size_fn is not used; the probes search for the exact boundary")
        largest, capped = self._search(lambda size: self._try(size, True, args, kwargs)[0])
        self.largest_fit = largest
        size = largest if capped else self._below(largest, self.margin, inclusive=True)
        logger.info(
            "batchfit: largest batch size that fits %d (%d probes%s); training at %d",
            largest,
            len(self.trials),
            ", every size up to max_batch_size fitted" if capped else "",
            size,
        )
        return self._descend(size, args, kwargs, lambda failed: self._below(failed, max(self.margin, REAL_CALL_STEP)))

    def _first_success(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        """Accelerate's semantics: go down from the start until a call completes."""
        reduce = self.reduce_batch_size_fn
        if reduce is not None:
            return self._descend(self.grid.init, args, kwargs, lambda failed: self._reduced(reduce, failed))
        # Accelerate's own step (10% less each time): a drop-in must not land lower than Accelerate does.
        return self._descend(self.grid.init, args, kwargs, lambda failed: self._below(failed, REAL_CALL_STEP))

    # the search ------------------------------------------------------------------------------------
    def _search(self, fits: Callable[[int], bool]) -> tuple[int, bool]:
        """The largest size that fits, and whether ``max_batch_size`` (not memory) ended the search.

        Up from a start that fits: [`batchfit.search.search`][batchfit.search.core.search] as is (doubling, then
        bisection). Down from a start that fails: halve until a size fits, then bisect between
        it and the smallest failure with the same search. Answers are cached so the search's
        first question (the size that just fitted) costs no second call.
        """
        known: dict[int, bool] = {}

        def oracle(size: int) -> _Verdict:
            if size not in known:
                known[size] = fits(size)
            return _Verdict(known[size])

        grid = self.grid
        if oracle(grid.init).fits:
            report = search(oracle, grid)
            return report.largest_fit, report.stop_reason == "max_batch"
        failed = grid.init
        while True:
            size = self._half(failed)
            if oracle(size).fits:
                break
            failed = size
        step = grid.multiple_of
        report = search(oracle, Grid(size, failed - step, step), _Below(failed))
        return report.largest_fit, False

    def _descend(self, size: int, args: tuple[Any, ...], kwargs: dict[str, Any], lower: Callable[[int], int]) -> T:
        """Real calls from ``size`` down (``lower(failed)`` gives the next) until one completes."""
        while True:
            fits, result, error = self._try(size, False, args, kwargs)
            if fits:
                self.batch_size, self._last_oom = size, None
                logger.info("batchfit: batch size %d ran (%d calls)", size, len(self.trials))
                return result  # type: ignore[return-value]
            next_size = lower(size)
            logger.warning("batchfit: batch size %d ran out of memory (%s); trying %d", size, error, next_size)
            size = next_size

    def _try(self, size: int, probe: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any, str]:
        """One call: ``(True, result, "")`` or ``(False, None, first line of the OOM)``.

        The OOM's traceback is dropped inside the handler and memory is freed after it: the
        frames of the failed call hold its tensors, and a retry that starts with them still
        live finds less memory than the size really has.
        """
        extra = {PROBE: probe} if self.takes_probe else {}
        try:
            result = self.function(size, *args, **kwargs, **extra)
        except Exception as exc:
            if not is_oom(exc):
                raise
            _drop_tracebacks(exc)
            self.trials.append((size, False))
            message = first_line(exc)
            self._last_oom = exc
        else:
            self.trials.append((size, True))
            if probe:
                del result
                _free_memory()
                return True, None, ""
            return True, result, ""
        _free_memory()
        return False, None, message

    # sizes -----------------------------------------------------------------------------------------
    def _half(self, failed: int) -> int:
        """Bisection of ``(0, failed)`` on the grid; raises when ``failed`` was the smallest size."""
        size = midpoint(0, failed, self.grid)
        if size < self.grid.multiple_of:
            self._nothing_fits(failed)
        return size

    def _below(self, size: int, fraction: float, inclusive: bool = False) -> int:
        """``size`` less ``fraction`` of it, on the grid and at least the smallest size.

        ``inclusive``: ``size`` itself is allowed (zero margin); otherwise the result is below
        ``size``, and when ``size`` is already the smallest, nothing fits.
        """
        step = self.grid.multiple_of
        target = math.floor(size * (1 - fraction) + 1e-9)
        target = max(step, target - target % step)
        if not inclusive:
            if size <= step:
                self._nothing_fits(size)
            target = min(target, size - step)
        return target

    def _reduced(self, reduce: Callable[[], int], failed: int) -> int:
        """The size ``reduce_batch_size_fn`` gives after ``failed``: an int below it (0: nothing fits)."""
        size = reduce()
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"reduce_batch_size_fn must return an int, got {type(size).__name__} {size!r}")
        if size < 1:
            self._nothing_fits(failed, "reduce_batch_size_fn reached zero")
        if size >= failed:
            raise ValueError(f"reduce_batch_size_fn returned {size} after {failed} ran out of memory; it must shrink")
        return size

    def _nothing_fits(self, failed: int, why: str = "even the smallest size ran out of memory") -> NoReturn:
        """Raise `NoExecutableBatchSizeError`, caused by the last OOM (its traceback dropped)."""
        cause, self._last_oom = self._last_oom, None
        raise NoExecutableBatchSizeError(
            failed,
            cause=first_line(cause) if cause is not None else None,
            advice=f"No executable batch size found: {why}.",
        ) from cause


def _inspect(function: Callable[..., Any]) -> tuple[bool, int | None]:
    """Whether ``function`` takes ``probe`` by keyword, and how many positional arguments it takes
    (``None``: any number, or unknown), for Accelerate's "batch size passed twice" guard."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return False, None
    takes_probe = any(p.name == PROBE and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters)
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return takes_probe, None
    positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != PROBE for p in parameters)
    return takes_probe, positional


def _drop_tracebacks(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and of the exceptions it chains to: their frames hold the
    failed call's tensors, which must be freed before the next try."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


def _free_memory() -> None:
    """Collect garbage (reference cycles can hold tensors) and give an accelerator's cached
    blocks back, so the next try starts from the same memory (the backend knows how)."""
    gc.collect()
    kind = default_device()
    if is_host(kind):
        return
    # A process that never touched the accelerator must not create its context just to empty it.
    initialized = getattr(getattr(torch, kind, None), "is_initialized", None)
    if initialized is None or initialized():
        device = torch.device(kind)
        backend_for(device).empty_cache(device)


@overload
def find_executable_batch_size(
    function: Callable[..., T],
    starting_batch_size: int = ...,
    reduce_batch_size_fn: Callable[[], int] | None = ...,
    *,
    max_batch_size: int = ...,
    multiple_of: int = ...,
    margin: float | None = ...,
    headroom: float | None = ...,
) -> ExecutableBatchSize[T]: ...


@overload
def find_executable_batch_size(
    function: None = ...,
    starting_batch_size: int = ...,
    reduce_batch_size_fn: Callable[[], int] | None = ...,
    *,
    max_batch_size: int = ...,
    multiple_of: int = ...,
    margin: float | None = ...,
    headroom: float | None = ...,
) -> Callable[[Callable[..., T]], ExecutableBatchSize[T]]: ...


def find_executable_batch_size(
    function: Callable[..., T] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
    *,
    max_batch_size: int = DEFAULT_MAX_BATCH,
    multiple_of: int = 1,
    margin: float | None = None,
    headroom: float | None = None,
) -> ExecutableBatchSize[T] | Callable[[Callable[..., T]], ExecutableBatchSize[T]]:
    """Decorate a training function ``f(batch_size, ...)`` so that it runs at a batch size that fits.

    Use it as Accelerate's decorator is used:

    ```python
    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size, probe=False):
        ...  # build loaders and model; if probe: run a few steps and return
    train()
    ```

    With a ``probe`` parameter the size is the exact largest that fits, less a ``margin`` of its samples, and
    the real run happens once. Without it the first size that completes wins, stepping down 10%
    after each out-of-memory as Accelerate does, or to what ``reduce_batch_size_fn`` returns (see
    the module docs for why, and for the differences from Accelerate).

    An evaluation loop is sized by decorating it too (its batch is larger than training's): call it
    once where the run evaluates, after an optimizer step, then reuse its size through
    ``evaluate.__wrapped__(evaluate.batch_size)`` (each decorated call searches again).
    """
    margin, _ = renamed("find_executable_batch_size", "headroom", headroom, "margin", margin, "a fraction of samples")
    margin = 0.0 if margin is None else margin
    if function is None:
        return functools.partial(  # type: ignore[return-value]
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
            max_batch_size=max_batch_size,
            multiple_of=multiple_of,
            margin=margin,
        )
    return ExecutableBatchSize(function, starting_batch_size, reduce_batch_size_fn, max_batch_size, multiple_of, margin)
