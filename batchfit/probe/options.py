"""Every option of a probe in one validated, frozen object, with its default and its part in the answer.

The keywords are named, typed and documented in `batchfit.probe.keywords`; here each has its
default, its check (bad values raise `TypeError` / `ValueError` naming the keyword as the user
wrote it) and what it does to the answer (`answer_settings`: one projection for the ranks'
agreement, the cache key and the result). Entry points build one `Options` (`options_from`) and
hand it on.

Pure Python apart from type hints: no torch import, so the CLI can validate before loading torch.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, get_args

from batchfit.probe import keywords
from batchfit.probe.keywords import Amp, FindOptions, check_keywords, split_hooks
from batchfit.report.records import Mode
from batchfit.search import Grid, Strategy, make_strategy
from batchfit.units import as_int, check_memory_limit, parse_reserve, positive_int

if TYPE_CHECKING:
    import torch

#: Above 65535 rows some CUDA kernels fail with "invalid configuration argument", which is not
#: an out-of-memory; the default ceiling stays below it.
DEFAULT_MAX_BATCH = 32768

MODES: tuple[str, ...] = get_args(Mode)
AMPS: tuple[str, ...] = get_args(Amp)


def _changes(
    section: str, how: str = "value", shown: Callable[[Options], Any] | None = None, keyed: str = "name"
) -> dict[str, Any]:
    """Field metadata: the option changes the answer, and the cache key holds it under `section`.
    `how`: `"value"` (its plain value, `shown(options)` when given: in `answer_settings`), `"code"`
    (a callable or optimizer, keyed by what it is, `keyed`: by its qualified `"name"`, as a
    `"criterion"` or an `"optimizer"`: `batchfit.probe.keys`) or `"resolved"` (keyed as the
    probe resolves it: the device, the limit in bytes, the reserve)."""
    return {"section": section, "how": how, "shown": shown, "keyed": keyed}


def _ranks(metadata: dict[str, Any]) -> dict[str, Any]:
    """Field metadata: a job's rank needs the option too (it builds its own model, batches and
    step, and waits for the others: `batchfit.probe.job_search.WORKER_OPTIONS`)."""
    return {**metadata, "ranks": True}


def _keeps(reason: str) -> dict[str, Any]:
    """Field metadata: the option cannot change the answer, for `reason` (the key leaves it out)."""
    return {"unchanged": reason}


@dataclass(frozen=True)
class Options:
    """What to run and how to search: every keyword of [`batchfit.find`][batchfit.find], with its default.

    The keywords are documented in `FindOptions` (`batchfit.probe.keywords`); `cache` is read only by
    `find` and `batchfit probe`."""

    make_batch: Callable[..., Any] | None = field(default=None, metadata=_changes("batch", "code"))
    loss_fn: Callable[[Any, Any], Any] | None = field(default=None, metadata=_changes("work", "code"))
    step_fn: Callable[[Any, Any], Any] | None = field(default=None, metadata=_changes("work", "code"))
    criterion: Callable[[Any, Any], Any] | None = field(
        default=None, metadata=_changes("work", "code", keyed="criterion")
    )
    optimizer: Any = field(default=None, metadata=_changes("work", "code", keyed="optimizer"))
    amp: Amp | None = field(default=None, metadata=_ranks(_changes("work")))
    mode: Mode = field(default="train", metadata=_ranks(_changes("work")))
    max_new_tokens: int | None = field(default=None, metadata=_ranks(_changes("work")))
    generate_fn: Callable[[Any, Any, int], Any] | None = field(default=None, metadata=_changes("work", "code"))
    eval_step: Callable[[Any, Any], Any] | None = field(default=None, metadata=_changes("work", "code"))
    eval: bool = field(default=False, metadata=_changes("work"))
    device: str | torch.device | None = field(default=None, metadata=_ranks(_changes("device", "resolved")))
    memory_limit: int | float | str | None = field(default=None, metadata=_ranks(_changes("search", "resolved")))
    reserve: int | str | None = field(default=None, metadata=_ranks(_changes("search", "resolved")))
    steps_per_trial: int | None = field(default=None, metadata=_changes("search"))
    headroom: float = field(default=0.10, metadata=_changes("search", shown=lambda o: float(o.headroom)))
    init_batch: int | None = field(default=None, metadata=_changes("search", shown=lambda o: o.first_batch))
    max_batch: int = field(default=DEFAULT_MAX_BATCH, metadata=_changes("search"))
    multiple_of: int = field(default=1, metadata=_changes("search"))
    verify_steps: int = field(default=2, metadata=_changes("search"))
    strategy: str | Strategy = field(
        default="interpolate", metadata=_changes("search", shown=lambda o: o.make_strategy().name)
    )
    time_budget: float | None = field(
        default=None,
        metadata=_changes("search", shown=lambda o: None if o.time_budget is None else float(o.time_budget)),
    )
    restore_rng: bool = field(default=True, metadata=_keeps("it sets what the generators hold afterwards"))
    distributed: bool | None = field(
        default=None, metadata=_keeps("batch sizes are per rank; a rank's memory does not depend on the world size")
    )
    rank_timeout: float = field(default=300.0, metadata=_ranks(_keeps("it bounds a wait, not what a trial measures")))
    seq_len: int | None = field(default=None, metadata=_ranks(_changes("search")))
    scan_batches: int | None = field(default=64, metadata=_ranks(_changes("search")))
    noise_scale: bool = field(default=False, metadata=_keeps("measured after the search, every time, never cached"))
    noise_passes: int = field(default=128, metadata=_keeps("it bounds the noise scale, measured every time"))
    timed_steps: int = field(default=1, metadata=_changes("search"))
    cache: str | os.PathLike[str] | None = field(default=None, metadata=_keeps("it says where the answer is kept"))

    def __post_init__(self) -> None:
        for name in COUNTS:  # numpy's int64, a 0-d tensor: kept as the int it holds (JSON, the grid)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, as_int(name, getattr(self, name)))
        if self.make_batch is not None and not callable(self.make_batch):
            raise TypeError(f"make_batch must be callable, got {type(self.make_batch).__name__}")
        for name in ("loss_fn", "step_fn", "criterion", "generate_fn", "eval_step"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        given = [name for name in ("loss_fn", "step_fn", "criterion") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"pass one of loss_fn, step_fn and criterion, not {' and '.join(given)} (each defines the loss)"
            )
        if self.optimizer is not None and not (callable(self.optimizer) or hasattr(self.optimizer, "param_groups")):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer, a factory params -> Optimizer, or None, "
                f"got {type(self.optimizer).__name__}"
            )
        device = self.device
        if device is not None and not (
            isinstance(device, (str, int)) and not isinstance(device, bool) or type(device).__name__ == "device"
        ):
            raise TypeError(f"device must be a str, a torch.device or None, got {type(device).__name__}")
        _choice("mode", self.mode, MODES)
        check_mode_options(self)
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

    @property
    def wait_for_ranks_s(self) -> float:
        """How long a rank waits for the others, joining the group and at each meeting: the one
        reading of ``rank_timeout`` (`batchfit.distributed` takes it in seconds)."""
        return float(self.rank_timeout)

    def untimed(self) -> Options:
        """These options with no warm timing: for probes whose rates nobody reads (the gate, a
        frontier length, a checkpointing policy's boundary), so their trials cost no timed steps."""
        return replace(self, timed_steps=0)

    def grid(self) -> Grid:
        """The sizes the search may try."""
        return Grid(init=self.first_batch, maximum=self.max_batch, multiple_of=self.multiple_of)

    def make_strategy(self) -> Strategy:
        return make_strategy(self.strategy)

    def answer_settings(self) -> dict[str, Any]:
        """Every option that changes the answer and is a plain value, as the answer sees it (the first
        batch resolved, the strategy by name, floats as floats): what every rank must search with
        alike, the cache key's settings and the result's `Settings`, from this one projection."""
        return {
            option.name: option.metadata["shown"](self) if option.metadata["shown"] else getattr(self, option.name)
            for option in fields(self)
            if option.metadata.get("how") == "value"
        }


def parameters_of(function: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """`function`'s parameters as a caller sees them: its `**options: Unpack[Group]` spelled out as
    keyword-only parameters with `Options`' defaults (a hook's: `HOOK_DEFAULTS`, a job search's:
    `JOB_DEFAULTS`), in place of the
    `**` one. What a type checker shows; what the contract tests compare across entry points."""
    spelled: dict[str, inspect.Parameter] = {}
    for name, parameter in inspect.signature(function).parameters.items():
        annotation = str(parameter.annotation)
        if parameter.kind is not parameter.VAR_KEYWORD or not annotation.startswith("Unpack["):
            spelled[name] = parameter
            continue
        group = getattr(keywords, annotation.removeprefix("Unpack[").removesuffix("]"))
        for key in keywords.keywords_of(group):
            default = {**_DEFAULTS, **keywords.HOOK_DEFAULTS, **keywords.JOB_DEFAULTS}[key]
            spelled[key] = inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=default)
    return spelled


def find_options(where: str, keywords: Mapping[str, Any]) -> Options:
    """The `Options` of `find`'s keywords as `where()` (an integration) was given them: unknown
    keywords refused by name, the hooks checked and set aside."""
    return Options(**split_hooks(where, keywords, FindOptions)[1])


def options_from(where: str, given: Mapping[str, Any], group: type = FindOptions, **fixed: Any) -> Options:
    """The `Options` of a call to `where()` given `given` keywords, which must be `group`'s (a
    `TypedDict` of `batchfit.probe.keywords`), and `fixed` ones the entry point sets itself."""
    check_keywords(where, given, group)
    return Options(**given, **fixed)


#: The options that count something, read off their declared type: each is an int (`as_int`) or None.
COUNTS = tuple(option.name for option in fields(Options) if option.type in ("int", "int | None"))

#: Each option's default, as `Options` declares it.
_DEFAULTS: dict[str, Any] = {option.name: option.default for option in fields(Options)}


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


def check_mode_options(options: Options) -> None:
    """The options that belong to one mode, named when given with another: `max_new_tokens` and
    `generate_fn` are generation's (which needs the first and trains nothing, so takes no optimizer
    or loss), `eval_step` the evaluation's, `eval=True` a training probe's."""
    mode = options.mode
    if not isinstance(options.eval, bool):
        raise TypeError(f"eval must be True or False, got {options.eval!r}")
    if mode == "generate":
        if options.max_new_tokens is None:
            raise ValueError("mode='generate' needs max_new_tokens=N: the tokens each row generates")
        positive_int("max_new_tokens", options.max_new_tokens)
        given = [
            name for name in ("optimizer", "loss_fn", "step_fn", "criterion") if getattr(options, name) is not None
        ]
        if given:
            raise ValueError(f"mode='generate' trains nothing: {', '.join(given)} does not apply (drop it)")
    else:
        for name in ("max_new_tokens", "generate_fn"):
            if getattr(options, name) is not None:
                raise ValueError(f"{name} applies to mode='generate' only (mode is {mode!r})")
    if options.eval and mode != "train":
        raise ValueError(
            f"eval=True sizes evaluation beside a training probe; mode is {mode!r} (use mode='eval' alone)"
        )
    if options.eval_step is not None and not (options.eval or mode == "eval"):
        raise ValueError("eval_step applies with eval=True or mode='eval' only")


def check_job_search(options: Options) -> None:
    """What a search whose every trial is a fresh ``torchrun`` job (`find_sharded`, ``--nproc-per-trial``)
    cannot honour, named: the ranks run in other processes and build their own model, so this
    process has no model to run code on, to probe in-process, to measure the noise of or to key."""
    code = [option.name for option in fields(options) if option.metadata.get("how") == "code"]
    for name in code:
        if getattr(options, name) is not None:
            raise ValueError(
                f"{name} cannot reach the ranks of a job (each builds its own model in another process): return it "
                f"from the target's factory instead, in a mapping {{'model': ..., 'sample': ..., {name!r}: ...}}"
            )
    refused = {
        "eval": "eval=True sizes evaluation after training in one process: size it in a job search of its own, "
        "mode='eval'",
        "noise_scale": "noise_scale=True measures the gradient noise of a model in this process, which holds none",
        "cache": "cache keeps the answer of a probe in this process; a job search keeps its jobs in trial_log",
        "distributed": "distributed: every job's ranks run the model's own collectives, never a probe across ranks",
    }
    for name, why in refused.items():
        if getattr(options, name) not in (None, False):
            raise ValueError(f"{why} (drop {name})")


def check_rank_limits(
    limits: Iterable[tuple[Any, Any]], world_size: int | None = None, name: str = "--memory-limit-per-rank"
) -> dict[int, int | float | str]:
    """Each rank's own `memory_limit` (what a rank of a `torchrun` job passes as
    ``find(memory_limit=limits[rank])``), given as ``(rank, limit)`` pairs: ``{rank: limit}``.
    Refused by name: a rank that is not a whole number from 0, a rank listed twice (which of the
    two would it take?), a limit `memory_limit` refuses, and, once the job's ``world_size`` is
    known, a rank the job does not have (a typo would otherwise leave that rank on the default)."""
    checked: dict[int, int | float | str] = {}
    for rank, limit in limits:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"{name}: a rank is a whole number from 0, got {rank!r}")
        if rank in checked:
            raise ValueError(f"{name} lists rank {rank} twice ({checked[rank]} and {limit}): give each rank once")
        check_memory_limit(limit, f"rank {rank}'s limit")
        checked[rank] = limit
    if not checked:
        raise ValueError(f"{name} lists no rank: give RANK=SIZE, e.g. 0=24GiB,1=16GiB")
    if world_size is not None:
        outside = sorted(rank for rank in checked if rank >= world_size)
        if outside:
            raise ValueError(
                f"{name} names rank {outside[0]}, but the job has {world_size} rank{'s' * (world_size != 1)} "
                f"(0 to {world_size - 1})"
            )
    return checked


def _choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def renamed(
    where: str,
    old: str,
    old_value: Any,
    new: str,
    new_value: Any,
    why: str = "as in batchfit.find()",
    stacklevel: int = 3,
) -> tuple[Any, str]:
    """The value of keyword ``new`` of ``where()``, also accepted under its old spelling ``old``
    with a ``DeprecationWarning``, and the name the user wrote, for messages that name it.
    ``why``: the warning's reason for the new name; ``stacklevel``: where the user's call is.

    Every entry point takes the same names for the same things (``find``'s); where one shipped
    with another name, that name keeps working until it is removed. Both at once is a
    ``TypeError``: they are one argument."""
    if old_value is None:
        return new_value, new
    if new_value is not None:
        raise TypeError(f"{where}() got both {old}= and {new}=: they are one argument, pass {new}= only")
    warnings.warn(
        f"{where}({old}=...) is now {where}({new}=...), {why}; {old}= will be removed",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return old_value, old
