"""A sharded model's search whose every trial is a fresh ``torchrun`` job, from ``init_batch`` or from a guess.

One path for [`batchfit.find_sharded`][batchfit.find_sharded] and ``batchfit probe TARGET
--nproc-per-trial N``: what every rank runs is built from the [`Options`][batchfit.Options] here
(`worker_request`, the options as JSON: `batchfit.probe.wire`), the jobs are `batchfit.probe.job_runner`'s
(`JobPerTrial`), and the search, the safe batch and the [`Result`][batchfit.Result] are `find()`'s own
(`search_with`).

From a guess (`FromGuess`: a safe batch per rank, or a `Result` whose safe batch and memory line
aim it, such as an estimate or an earlier answer), the first job is the guessed safe batch's
verification, each rank under its own budget less the headroom; its peak and the bytes per sample
put the next job on the boundary, and one more job shows the size above it fails. When the guess
holds, that is three jobs for an exact, verified answer, where a search from ``init_batch`` needs
about six; when it does not, the search goes on (`search_near`) and stays exact.

The trial log's key (`log_key`) is what changes a job's verdicts and can be known before a job:
the target (its name, and the path and SHA-256 of the file its factory is in), the device's
identity, the ranks and the options they run with, torch's and batchfit's versions. The sharded estimate
a search started from is logged under it too (`log_estimate`), so that a resume takes the same path
without making it again.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from batchfit.backends import backend_for, default_device
from batchfit.backends.select import is_host
from batchfit.probe.cache_files import TRIAL_LOG_SCHEMA, append_line, read_file, read_trial_log
from batchfit.probe.finder import search_with
from batchfit.probe.job_runner import JobPerTrial, Opening
from batchfit.probe.keywords import ProbeStartCallback, StartCallback, TrialCallback
from batchfit.probe.options import Options
from batchfit.probe.probing import Oracle
from batchfit.probe.wire import CLI_CPU_MEMORY_LIMIT, WorkerRequest, to_wire
from batchfit.report import MemoryModel, Result, Trial, Unit
from batchfit.search import Grid, SearchReport, Strategy, search, search_near
from batchfit.version import __version__

#: The options a job's ranks need, where not at their default (each rank builds its own model,
#: batches and step, and waits for the others); the search's options stay with the driver, and a
#: code option comes from the target.
WORKER_OPTIONS = tuple(option.name for option in fields(Options) if option.metadata.get("ranks"))


def worker_options(options: Options) -> Options:
    """``options`` as a rank of a job runs them: the device resolved here (the driver's default,
    ``cuda`` is each rank's own ``cuda:LOCAL_RANK`` there), and on the CPU without a memory limit the
    command line's (`CLI_CPU_MEMORY_LIMIT`)."""
    device = str(options.device if options.device is not None else default_device())
    limit = options.memory_limit
    if limit is None and is_host(device):
        limit = CLI_CPU_MEMORY_LIMIT
    return replace(options, device=device, memory_limit=limit)


def worker_request(target: str, world_size: int, options: Options) -> WorkerRequest:
    """What every rank of every job runs: a trial of ``target`` with the options it needs (the
    trial itself and the job's folder are each job's: `batchfit.probe.job_runner.JobPerTrial`)."""
    wire = to_wire(worker_options(options), WORKER_OPTIONS)
    return WorkerRequest(kind="trial", target=target, options=wire, world_size=world_size, out="")


def find_sharded_with(
    target: str,
    world_size: int,
    options: Options,
    *,
    trial_log: str | os.PathLike[str] | None,
    trial_timeout: float,
    guess: int | Result | None = None,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
) -> Result:
    """[`find_sharded`][batchfit.find_sharded] for callers that hold checked input (the CLI included).

    Raises:
        TypeError: ``guess`` is neither an int nor a `Result`.
    """
    started = time.monotonic()
    request = worker_request(target, world_size, options)
    key = log_key(target, world_size, options)
    log = Path(trial_log) if trial_log is not None else None
    opening: Opening | None = None
    slope: float | None = None
    if guess is not None:
        safe, slope = aim(guess, options.grid())
        opening = Opening(safe)
        if options.verify_steps:  # the headroom off each rank's budget: none at init_batch (`SearchRun.verify_cap`)
            headroom = options.headroom if safe > options.grid().init else None
            opening = Opening(safe, "verify", options.verify_steps, headroom)
    prober = JobPerTrial(request, world_size, options, log=log, timeout_s=trial_timeout, key=key, opening=opening)
    plan = None
    if opening is not None:
        plan = FromGuess(
            opening.batch_size, slope, prober.state_bytes, opening.kind == "verify", options.make_strategy()
        )
    return search_with(
        prober, options, started, callback=callback, on_trial_start=on_trial_start, on_start=on_start, plan=plan
    )


def log_key(target: str, world_size: int, options: Options) -> dict[str, Any]:
    """What a logged job must match to be reused: everything that changes its verdicts and is known
    before a job (see the module docs). Not the modules the target's file imports, nor the
    environment (``PYTORCH_CUDA_ALLOC_CONF``): after changing those, start a new log."""
    return {
        "target": target,
        "target_file": target_file(target),
        "device": device_identity(options.device),
        "world_size": world_size,
        "worker": worker_request(target, world_size, options).options,
        "torch": torch.__version__,
        "batchfit": __version__,
    }


def target_file(target: str) -> dict[str, str | None]:
    """The file a rank loads the target's factory from, found as a rank finds it (a path, else the
    module on the working directory and ``sys.path``) without running it: its path and the SHA-256
    of its bytes; ``None`` for what cannot be found or read (no rank could load it either)."""
    where = target.rpartition(":")[0]
    path = _module_file(where)
    text = None if path is None else read_file(path)[0]
    digest = None if text is None else hashlib.sha256(text).hexdigest()
    return {"path": None if path is None else str(path), "sha256": digest}


def _module_file(where: str) -> Path | None:
    if where.endswith(".py") or os.sep in where or (os.altsep and os.altsep in where):
        return Path(where).resolve()
    search: list[str] = [os.getcwd(), *sys.path]
    parts = where.split(".")
    spec = None
    for depth in range(1, len(parts) + 1):  # each package found, none imported
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    return Path(spec.origin) if spec is not None and spec.origin and spec.has_location else None


def device_identity(device: Any) -> dict[str, Any]:
    """The device the ranks run on, as its backend describes it: its type, name and memory (not its
    index: every rank has its own). The driver's view of it, before any job."""
    where = torch.device(device if device is not None else default_device())
    backend = backend_for(where)
    info = backend.describe(backend.validate(where))
    return {"type": info.type, "name": info.name, "total_bytes": info.total_bytes}


def logged_estimate(log: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The sharded estimate logged under ``key`` in the trial log ``log`` (its ``result`` and why it
    ``failed``), ``None`` when there is none (`batchfit.probe.cache_files.read_trial_log`'s checks)."""
    return read_trial_log(log, key, key["world_size"]).estimate


def log_estimate(log: Path, key: dict[str, Any], estimated: Result | None, failed: str | None) -> None:
    """Log the sharded estimate a search starts from (or why it failed) under ``key``."""
    entry = {
        "schema": TRIAL_LOG_SCHEMA,
        "kind": "estimate",
        "key": key,
        "result": None if estimated is None else estimated.to_dict(),
        "failed": failed,
    }
    append_line(log, json.dumps(entry, sort_keys=True))


def aim(guess: int | Result, grid: Grid) -> tuple[int, float | None]:
    """The safe batch a guess predicts, on the grid, and its bytes per sample when it knows them."""
    if isinstance(guess, Result):
        safe, memory = guess.safe_batch, guess.memory
        slope = memory.per_sample_bytes if memory is not None and memory.per_sample_bytes > 0 else None
    elif isinstance(guess, int) and not isinstance(guess, bool):
        safe, slope = guess, None
    else:
        raise TypeError(
            f"guess must be a safe batch per rank (an int) or a batchfit.Result (an estimate, an earlier answer), "
            f"got {type(guess).__name__}"
        )
    return max(grid.init, min(grid.top, grid.floor(max(safe, 1)))), slope


@dataclass(frozen=True)
class FromGuess:
    """The job search from a guessed safe batch (a `SearchPlan`): the first trial is its verification
    (the prober's first job, `Opening`), then `search_near` from the boundary that trial's peak and
    the bytes per sample predict (the guess's, else the peak less the model's state per sample).
    A guess too high (its trial failed) is no place to start from: `find`'s search from ``init_batch``
    follows, as it would have without the guess, one job later."""

    safe: int
    per_sample_bytes: float | None
    state_bytes: Callable[[], int]
    verifies: bool
    strategy: Strategy
    #: A verification is the safe batch only where the memory line agrees to the batch: the answer
    #: is the one a search from ``init_batch`` gives.
    keep_verified_within: float = 0.0

    def search(
        self, oracle: Oracle, grid: Grid, *, should_stop: Callable[[], bool], budget_bytes: int | None
    ) -> SearchReport:
        """`search_near`, anchored on the first job's trial at the guessed safe batch."""
        first = oracle(self.safe, kind="verify") if self.verifies else oracle(self.safe)
        slope = self.per_sample_bytes
        if slope is None and first.fits and first.peak_bytes is not None:
            measured = (first.peak_bytes - self.state_bytes()) / self.safe
            slope = measured if measured > 0 else None
        if not first.fits:
            return search(oracle, grid, strategy=self.strategy, should_stop=should_stop, budget_bytes=budget_bytes)
        guess = float(self.safe)
        if first.fits and first.peak_bytes is not None and budget_bytes is not None and slope:
            guess = self.safe + (budget_bytes - first.peak_bytes) / slope
        guess = guess if math.isfinite(guess) else float(grid.top)
        anchor = (self.safe, lambda size: first)  # run already: it opened the search
        return search_near(oracle, grid, guess, slope or 0.0, budget_bytes, should_stop, anchor=anchor)

    def memory_hint(self, trials: list[Trial], budget: int | None, unit: Unit) -> MemoryModel | None:
        """No hint: the trials measure the memory line (`FromInit`'s)."""
        return None
