"""Every knob of a probe in one validated, frozen object.

:func:`batchfit.find`, :class:`batchfit.Prober`, :func:`batchfit.testing.check_fits` and the CLI
all take the same options; they build one :class:`Options` and hand it on, so each knob is
defined, defaulted and validated here, once. Bad values raise ``TypeError`` / ``ValueError``
naming the argument as the user wrote it (``init_batch``, not an internal field).

Pure Python apart from type hints: no torch import, so the CLI can validate before loading torch.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from batchfit.search import Grid, Strategy, make_strategy
from batchfit.units import as_int, check_memory_limit, parse_reserve, positive_int

if TYPE_CHECKING:
    import torch

#: Above 65535 rows some CUDA kernels fail with "invalid configuration argument", which is not
#: an out-of-memory; the default ceiling stays below it.
DEFAULT_MAX_BATCH = 32768

Mode = Literal["train", "inference"]
Amp = Literal["bf16", "fp16"]
MODES: tuple[str, ...] = ("train", "inference")
AMPS: tuple[str, ...] = ("bf16", "fp16")


#: The fields of :class:`Options` that count something: each is an int (:func:`as_int`) or ``None``.
COUNTS = (
    "steps_per_trial",
    "init_batch",
    "max_batch",
    "multiple_of",
    "verify_steps",
    "seq_len",
    "scan_batches",
    "noise_passes",
    "timed_steps",
)


@dataclass(frozen=True)
class Options:
    """What to run and how to search. Field names and defaults are :func:`batchfit.find`'s.

    The work: ``make_batch``, ``loss_fn``, ``step_fn``, ``criterion``, ``optimizer``, ``amp``, ``mode``,
    ``device``, ``memory_limit``, ``reserve``, ``steps_per_trial``. The search: ``headroom``,
    ``init_batch``, ``max_batch``, ``multiple_of``, ``verify_steps``, ``strategy``,
    ``time_budget``. The restore: ``restore_rng``. Many ranks: ``distributed``,
    ``rank_timeout``. Real data: ``seq_len``, ``scan_batches`` (``batchfit.probe.real_data``).
    The batch to train with: ``noise_scale``, ``noise_passes`` (``batchfit.probe.noise``),
    ``timed_steps`` (warm timed steps per size the throughput answer compares). The result cache:
    ``cache`` (a directory, ``batchfit.probe.cache``; only :func:`batchfit.find` and ``batchfit probe``
    read it). See :func:`batchfit.find` for what each one means.
    """

    make_batch: Callable[..., Any] | None = None
    loss_fn: Callable[[Any, Any], Any] | None = None
    step_fn: Callable[[Any, Any], Any] | None = None
    criterion: Callable[[Any, Any], Any] | None = None
    optimizer: Any = None
    amp: Amp | None = None
    mode: Mode = "train"
    device: str | torch.device | None = None
    memory_limit: int | float | str | None = None
    reserve: int | str | None = None
    steps_per_trial: int | None = None
    headroom: float = 0.10
    init_batch: int | None = None
    max_batch: int = DEFAULT_MAX_BATCH
    multiple_of: int = 1
    verify_steps: int = 3
    strategy: str | Strategy = "interpolate"
    time_budget: float | None = None
    restore_rng: bool = True
    distributed: bool | None = None
    rank_timeout: float = 300.0
    seq_len: int | None = None
    scan_batches: int | None = 64
    noise_scale: bool = False
    noise_passes: int = 128
    timed_steps: int = 2
    cache: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        for name in COUNTS:  # numpy's int64, a 0-d tensor: kept as the int it holds (JSON, the grid)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, as_int(name, getattr(self, name)))
        if self.make_batch is not None and not callable(self.make_batch):
            raise TypeError(f"make_batch must be callable, got {type(self.make_batch).__name__}")
        for name in ("loss_fn", "step_fn", "criterion"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        given = [name for name in ("loss_fn", "step_fn", "criterion") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"pass one of loss_fn, step_fn and criterion, not {' and '.join(given)} (each defines the loss)"
            )
        _choice("mode", self.mode, MODES)
        _choice("amp", self.amp, (None, *AMPS))
        if self.memory_limit is not None:
            check_memory_limit(self.memory_limit)  # syntax and sign; a fraction resolves on the device
        if self.reserve is not None:
            parse_reserve(self.reserve)
        if not isinstance(self.restore_rng, bool):
            raise TypeError(f"restore_rng must be True or False, got {self.restore_rng!r}")
        if self.distributed is not None and not isinstance(self.distributed, bool):
            raise TypeError(f"distributed must be True, False or None, got {self.distributed!r}")
        timeout = self.rank_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(f"rank_timeout must be a positive, finite number of seconds, got {timeout!r}")
        if self.steps_per_trial is not None:
            positive_int("steps_per_trial", self.steps_per_trial)
        positive_int("verify_steps", self.verify_steps, minimum=0)
        headroom = self.headroom
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
            raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}")
        budget = self.time_budget
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0
        ):
            raise ValueError(f"time_budget must be a positive, finite number of seconds, got {budget!r}")
        positive_int("multiple_of", self.multiple_of)
        positive_int("max_batch", self.max_batch)
        if self.init_batch is not None:
            positive_int("init_batch", self.init_batch)
        elif self.multiple_of > self.max_batch:
            # Without an init_batch the first size is multiple_of itself: name what the user gave.
            raise ValueError(
                f"multiple_of={self.multiple_of} is above max_batch={self.max_batch}: no batch size up to "
                "max_batch is a multiple of it"
            )
        self.grid()  # init_batch against max_batch and multiple_of
        make_strategy(self.strategy)
        if self.scan_batches is not None:  # None: the whole epoch
            positive_int("scan_batches", self.scan_batches)
        if not isinstance(self.noise_scale, bool):
            raise TypeError(f"noise_scale must be True or False, got {self.noise_scale!r}")
        positive_int("noise_passes", self.noise_passes, minimum=4)
        positive_int("timed_steps", self.timed_steps, minimum=0)
        if self.cache is not None:
            if not isinstance(self.cache, (str, os.PathLike)):
                kind = type(self.cache).__name__
                raise TypeError(f"cache must be a directory (a str or os.PathLike) or None, got {kind}")
            if not os.fspath(self.cache):
                raise ValueError("cache must name a directory, got an empty path")
        if self.seq_len is not None:
            positive_int("seq_len", self.seq_len)
            if self.make_batch is not None:
                check_takes_length(
                    self.make_batch,
                    f"with seq_len={self.seq_len}, make_batch is called as make_batch(batch_size, seq_len)",
                )

    def batch_maker(self) -> Callable[[int], Any] | None:
        """``make_batch`` as every probe calls it, ``batch_size -> batch``: with ``seq_len`` the
        user's callable takes the length too, ``make_batch(batch_size, seq_len)``. One place, so
        that find, estimate, the gate and the CLI build the same batches."""
        make, seq_len = self.make_batch, self.seq_len
        if make is None or seq_len is None:
            return make
        return lambda batch_size: make(batch_size, seq_len)

    @property
    def first_batch(self) -> int:
        """``init_batch``, or its default: 2 (BatchNorm cannot train on one sample), or
        ``multiple_of`` when larger, and 1 when ``max_batch`` is 1."""
        if self.init_batch is not None:
            return self.init_batch
        if self.multiple_of == 1 and self.max_batch < 2:
            return 1
        return max(self.multiple_of, 2)

    def grid(self) -> Grid:
        """The sizes the search may try."""
        return Grid(init=self.first_batch, maximum=self.max_batch, multiple_of=self.multiple_of)

    def make_strategy(self) -> Strategy:
        return make_strategy(self.strategy)


def check_takes_length(make_batch: Callable[..., Any], said: str) -> None:
    """``make_batch`` will be called as ``make_batch(batch_size, seq_len)``: a one-argument
    callable is named now, not as a ``TypeError`` inside the first trial. ``said``: the message's
    first clause, why it is called so. Shared by ``seq_len=`` and the frontier."""
    try:
        signature = inspect.signature(make_batch)
    except (TypeError, ValueError):  # a builtin or C callable: its call will say what it needs
        return
    try:
        signature.bind(1, 1)
    except TypeError:
        name = getattr(make_batch, "__qualname__", type(make_batch).__name__)
        raise TypeError(f"{said}; {name}{signature} does not take two arguments") from None


def _choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def renamed(where: str, old: str, old_value: Any, new: str, new_value: Any) -> tuple[Any, str]:
    """The value of keyword ``new`` of ``where()``, also accepted under its old spelling ``old``
    with a ``DeprecationWarning``, and the name the user wrote, for messages that name it.

    Every entry point takes the same names for the same things (``find``'s); where one shipped
    with another name, that name keeps working until it is removed. Both at once is a
    ``TypeError``: they are one argument."""
    if old_value is None:
        return new_value, new
    if new_value is not None:
        raise TypeError(f"{where}() got both {old}= and {new}=: they are one argument, pass {new}= only")
    warnings.warn(
        f"{where}({old}=...) is now {where}({new}=...), as in batchfit.find(); {old}= will be removed",
        DeprecationWarning,
        stacklevel=3,
    )
    return old_value, old
