"""[`find`][batchfit.find] of a target (``find(target, world_size=N)``): a sharded model's batch sizes, every
trial a fresh ``torchrun`` job; [`find_sharded`][batchfit.find_sharded], its alias.

The Python way in, and the command line's (``batchfit probe TARGET --nproc-per-trial N`` calls it):
the arguments checked before any job, the search started from the sharded estimate where one can be
made (`batchfit.estimation.rank_estimate`), the jobs and the search run by `batchfit.probe.job_search`.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchfit.errors import first_line
from batchfit.probe import Options
from batchfit.probe.keywords import JOB_DEFAULTS, EstimateOptions, FindOptions, keywords_of, split_hooks
from batchfit.probe.options import check_job_search, renamed
from batchfit.probe.wire import to_wire
from batchfit.report import Result
from batchfit.units import parse_memory_limit
from batchfit.view.progress import Progress

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from batchfit.probe.keywords import FindJobKeywords, FindKeywords

__all__ = ["find_sharded", "find_target"]


def find_sharded(
    target: str, world_size: int | None = None, *, nproc: int | None = None, **keywords: Unpack[FindJobKeywords]
) -> Result:
    """[`find`][batchfit.find] of a target over jobs of `world_size` ranks: `find(target, world_size=world_size, ...)`.

    Kept as the name the job search shipped with; the same call, the same answer. `nproc=`, its
    old name for `world_size`, still works with a `DeprecationWarning`.
    """
    world_size, name = renamed("find_sharded", "nproc", nproc, "world_size", world_size)
    return find_target(target, world_size, size_name=name, **keywords)


def find_target(
    target: str,
    world_size: int | None,
    *,
    trial_log: str | os.PathLike[str] | None = None,
    trial_timeout: float = JOB_DEFAULTS["trial_timeout"],
    guess: int | Result | None = None,
    estimate: bool = JOB_DEFAULTS["estimate"],
    size_name: str = "world_size",
    **keywords: Unpack[FindKeywords],
) -> Result:
    """[`find`][batchfit.find] for a sharded model (FSDP, FSDP2): each trial a `torchrun` job of `world_size` ranks.

    Each rank joins the process group, then calls the target's factory (so it may call
    `fully_shard`), runs one trial with the model's own collectives and writes its verdict; the
    first rank out of memory ends its job at once, so no rank waits in a collective
    (`batchfit.probe.job_runner`). The search, the safe batch and the answer are `find`'s, from this
    process, which loads no model. `batchfit probe TARGET --nproc-per-trial N` runs the same.

    Args:
        target: `"package.module:factory"` or `"path/to/file.py:factory"`, a factory that returns
            `(model, sample)` or a mapping with `model`, `sample` and optionally `optimizer`,
            `loss_fn`, `step_fn`, ... (what `batchfit probe` takes).
        world_size: the ranks of every job (`--nproc-per-node`); batch sizes are per rank.
        trial_log, trial_timeout, guess, estimate: the job search's own
            ([`JobOptions`][batchfit.probe.keywords.JobOptions]). A trial log is keyed by the target's
            file (its SHA-256), the device, the ranks and their options and the versions; a line a
            crash cut off is skipped, a verdict that contradicts itself is not reused
            (docs/how-to/sharded-jobs.md). A `guess`'s first job verifies its safe batch, the next
            goes to the boundary: three jobs when the guess holds, and the answer is exact either
            way. The estimate is `batchfit.estimation.rank_estimate.estimate_sharded`'s; when it
            cannot be made, the search starts from `init_batch` and a note says why.
        size_name: the name the caller gave `world_size` under, for its messages.
        **keywords: `find`'s options and hooks. The code options (`loss_fn`, `optimizer`, ...) come
            from the target instead; `eval`, `noise_scale`, `cache` and `distributed` are refused.
            On CPU without `memory_limit` each rank takes the command line's 256 MiB.

    Returns:
        The frozen [`Result`][batchfit.Result], per rank, as `find` gives it (its `world_size` too).

    Raises:
        TypeError, ValueError: a bad argument, named, before any job starts (a ``trial_log`` that is
            not a regular file, or not a trial log, included).
        RankFailedError: a rank failed with an error that is not an out-of-memory.
        RanksTimeoutError: a job gave no answer within `trial_timeout`, or a rank stopped answering (named).
        NothingFitsError: even the first size runs out of memory.
    """
    check_sharded_call(target, world_size, trial_log, trial_timeout, guess, size_name)
    if not isinstance(estimate, bool):
        raise TypeError(f"estimate must be True or False, got {estimate!r}")
    hooks, given = split_hooks("find", keywords, FindOptions)
    options = Options(**given)
    check_job_search(options)
    progress = hooks.pop("progress", False)
    started = time.monotonic()
    assert world_size is not None  # checked above
    # lazy: torch, which find of a model and a plan must not load
    from batchfit.probe.job_search import find_sharded_with

    said: list[str] = []
    if guess is None and estimate:
        guess, said = estimated_guess(target, world_size, options, trial_timeout, trial_log)
    run = {"trial_log": trial_log, "trial_timeout": trial_timeout, "guess": guess}
    if not progress:
        result = find_sharded_with(target, world_size, options, **run, **hooks)
    else:
        told = (hooks.get(name) for name in ("callback", "on_trial_start", "on_start"))
        with Progress(target, *told) as shown:
            result = find_sharded_with(target, world_size, options, **run, **shown.callbacks())
            shown.summary(result)
    return replace(result, notes=(*said, *result.notes), elapsed_s=time.monotonic() - started)


def check_sharded_call(
    target: Any, world_size: Any, trial_log: Any, trial_timeout: Any, guess: Any, size_name: str = "world_size"
) -> None:
    """The job search's own arguments, named when wrong (`world_size` as ``size_name``), before any job starts."""
    if not isinstance(target, str):
        raise TypeError(f"target must be a str, 'package.module:factory', got {type(target).__name__}")
    where, _, factory = target.rpartition(":")
    if not (where and factory):
        raise ValueError(
            f"target must name a factory as 'package.module:factory' or 'path/to/file.py:factory', got {target!r}"
        )
    if world_size is None:
        raise TypeError(
            f"find({target!r}) needs world_size=: the ranks of every job its trials run (torchrun's --nproc-per-node)"
        )
    said = f"{size_name} must be a positive int (the ranks of every job)"
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"{said}, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"{said}, got {world_size}")
    if trial_log is not None and not (isinstance(trial_log, (str, os.PathLike)) and os.fspath(trial_log)):
        raise TypeError(f"trial_log must be a file path (a str or os.PathLike) or None, got {trial_log!r}")
    timeout = trial_timeout
    number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not number or not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"trial_timeout must be a positive, finite number of seconds, got {timeout!r}")
    if not (guess is None or isinstance(guess, Result) or isinstance(guess, int) and not isinstance(guess, bool)):
        raise TypeError(
            f"guess must be a safe batch per rank (an int), a batchfit.Result (an estimate, an earlier answer) or "
            f"None, got {type(guess).__name__}"
        )
    if isinstance(guess, int) and guess < 1:
        raise ValueError(f"guess must be a positive batch size, got {guess}")


def estimated_guess(
    target: str, world_size: int, options: Options, timeout_s: float, trial_log: str | os.PathLike[str] | None = None
) -> tuple[Result | None, list[str]]:
    """The sharded estimate the search starts from, and a note; `None` and why not, when it cannot be made
    (within ``timeout_s``, as a job). With a trial log, the estimate logged under the same key when
    there is one (a resume takes the search's path again without the estimate's seconds), else the
    one made now, logged."""
    limit = options.memory_limit
    try:
        parse_memory_limit(limit, None) if limit is not None else None
    except ValueError:
        limit = None  # a fraction: the device's size is not known here
    if limit is None:
        return None, ["the search started from init_batch: the sharded estimate needs memory_limit as a size"]
    from batchfit.backends import default_device  # lazy: the backends load torch
    from batchfit.estimation import estimate_sharded  # lazy: torch, as the backends
    from batchfit.probe.job_search import log_estimate, log_key, logged_estimate  # lazy: torch, once a job runs

    device = str(options.device or default_device()).split(":")[0]
    keywords = to_wire(options, keywords_of(EstimateOptions), plain_only=True)
    log = Path(trial_log) if trial_log is not None else None
    key = {"estimate": {"device": device, "memory_limit": limit, **keywords}}
    key = {**log_key(target, world_size, options), **key} if log is not None else key
    logged = logged_estimate(log, key) if log is not None else None
    if logged is not None and logged["result"] is None:
        return None, [f"the search started from init_batch: the sharded estimate failed ({logged['failed']}; the trial "
                      f"log {log} says so)"]  # fmt: skip
    if logged is not None:
        estimated = Result.from_dict(logged["result"])
        return estimated, [
            f"the search started from the sharded estimate (max batch {estimated.max_batch}, safe batch "
            f"{estimated.safe_batch} per rank, read from the trial log {log}: not made again, no job)"
        ]
    started = time.monotonic()
    try:
        estimated = estimate_sharded(
            target,
            world_size,
            memory_limit=limit,
            device=device,
            reserve=options.reserve,
            timeout_s=timeout_s,
            **keywords,
        )
    except Exception as exc:  # noqa: BLE001 (the jobs still give the answer; the note says why they started low)
        if log is not None:
            log_estimate(log, key, None, first_line(exc))
        return None, [f"the search started from init_batch: the sharded estimate failed ({first_line(exc)})"]
    if log is not None:
        log_estimate(log, key, estimated, None)
    return estimated, [
        f"the search started from the sharded estimate (max batch {estimated.max_batch}, safe batch "
        f"{estimated.safe_batch} per rank, made in {time.monotonic() - started:.1f} s, no job)"
    ]
