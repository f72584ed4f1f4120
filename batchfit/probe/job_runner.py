"""Sharded models (FSDP, FSDP2): every trial a fresh ``torchrun`` job, the search in one driver.

Why: a sharded model runs collectives *inside* forward and backward (FSDP all-gathers each
unit's parameters before its forward and reduce-scatters its gradients in backward). A rank that
runs out of memory there leaves its peers waiting inside a collective, and no meeting between
phases can prevent it: the out-of-memory is often the all-gather's own output buffer, allocated
right before the collective starts. And after such an out-of-memory FSDP's state is not fit for
another step in the same process (Composer's FSDP2 notes). So instead of probing in-process,
``batchfit probe TARGET --nproc-per-trial N`` runs the search in a single driver process, and
every trial is a fresh job (DeepSpeed's autotuner does the same):

* the driver writes the trial as a `batchfit.probe.wire.WorkerRequest` and starts ``torchrun
  --standalone --nproc-per-node N -m batchfit.worker REQUEST`` (`batchfit.probe.job_worker` is the
  rank's side); each rank joins the process group *before* it loads the target (so the
  target's factory can call ``fully_shard``), runs one trial of its own (``distributed=False``:
  no meetings, the model's collectives run as in training), and writes its verdict to a file as
  soon as it has one, before anything else can hang;
* the driver watches those files: all ranks fitted, the trial fitted; the first rank that ran out
  of memory (or failed) decides at once, and the driver kills the whole job, including ranks
  stuck in a collective, so a hang costs nothing but the job; a job that gives no answer within
  ``--trial-timeout`` seconds is killed and reported;
* with ``--trial-log PATH`` every job's verdicts are appended to a JSON-lines log, and a later run
  with the same settings reuses them instead of running those jobs again (resume after Ctrl-C, a
  node failure, or a change of search options); a verification's entry records the cap it ran under;
* the first job is `Opening`'s: ``init_batch`` (it tells the driver the budget every rank has), or,
  for a search from a guess (`batchfit.probe.job_search`), the guessed safe batch's verification, each
  rank under its own budget less the headroom (the driver learns the budget from that same job).

The search, the safe batch and the result are ``find()``'s own (`batchfit.probe.finder.search_with`);
`JobPerTrial` stands in for [`Prober`][batchfit.Prober] (both are a `batchfit.probe.runner.Runner`). Every job
starts a fresh optimizer, so a trial runs two steps (step 1 allocates the optimizer state).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from batchfit.distributed import Solo, combine_trials
from batchfit.errors import RanksTimeoutError
from batchfit.probe.cache_files import TRIAL_LOG_SCHEMA, append_line, read_trial_log
from batchfit.probe.checks import fit_memory
from batchfit.probe.job_worker import raise_failure, read_verdicts, worker_env
from batchfit.probe.notes import ranks_notes
from batchfit.probe.options import Options
from batchfit.probe.runner import Findings, GroupAnswer, Settled, Setup, Traits, TrialRequest
from batchfit.probe.safe_batch import safe_cap
from batchfit.probe.sessions import end_torchrun, in_session
from batchfit.probe.wire import WorkerRequest, worker_command
from batchfit.report import DeviceInfo, Trial, TrialKind, Unit

#: Steps of a trial in a fresh job: step 1 allocates the optimizer state, step 2 runs with it.
FRESH_STEPS = 2


@dataclass(frozen=True)
class Opening:
    """The first job, which also tells the driver the budget, the device and the limit of every rank.

    ``headroom``: run under each rank's own budget less this fraction (a verification whose cap the
    driver cannot compute before a job has told it the budget); ``None``: under the budget."""

    batch_size: int
    kind: TrialKind = "search"
    steps: int | None = None
    headroom: float | None = None


class JobPerTrial:
    """A probe whose every trial is a fresh ``torchrun`` job of ``nproc`` ranks (see the module docs).

    ``request``: what every rank of a job runs (`batchfit.probe.wire.WorkerRequest`: the target and
    the options its trial needs, `batchfit.probe.job_search.worker_request`), less the trial itself;
    ``key``: the settings a logged verdict must match to be reused; ``opening``: the first job
    (default: ``init_batch``).
    """

    def __init__(
        self,
        request: WorkerRequest,
        nproc: int,
        options: Options,
        *,
        log: Path | None = None,
        timeout_s: float = 600.0,
        key: dict[str, Any] | None = None,
        opening: Opening | None = None,
    ) -> None:
        self.request = request
        self.opening = opening or Opening(options.grid().init)
        self.options = options
        self.ranks = Solo(nproc)  # the ranks of every job, as the search sees them: one driver decides alone
        self.log = log
        self.timeout_s = timeout_s
        self.key = dict(key or {})
        self.notes: list[str] = []
        self.budget_bytes: int | None = None
        self.counts: Unit = "allocated"
        self.device_info = DeviceInfo(type="unknown")
        self.limit_bytes: int | None = None
        self.limit_source = "memory_limit"
        self.reserve_bytes = 0
        self.jobs = 0
        self.reused = 0
        self._first: tuple[tuple[int, str, int, int | None], Trial] | None = None
        self._facts: dict[str, Any] = {}
        #: The state a rank holds (its shards), as the largest job that completed its steps said: a job
        #: that ran out of memory mid-step read its weights gathered and its optimizer state unmade.
        self._state: tuple[int, dict[str, Any]] = (0, {})
        self._logged = self._read_log()

    # lifetime ------------------------------------------------------------------------------------
    def open(self) -> Setup:
        """Run the first job (`Opening`): it is also what tells the driver the budget, the device and
        the limit every rank has. The search's first trial of the same size, kind, steps and cap is it.
        Every trial is a fresh job: no layout carries, no size is timed warm; each worker builds its
        own batches, so the driver does not know which batch they were sized on."""
        opening = self.opening
        steps = opening.steps or self.options.steps_per_trial or FRESH_STEPS
        trial, cap = self._logged_or_run(opening.batch_size, steps, None, opening.headroom)
        self._first = (opening.batch_size, opening.kind, steps, cap), replace(trial, kind=opening.kind, cap_bytes=cap)
        facts = (self.budget_bytes, self.counts, self.device_info, self.ranks, self.limit_bytes, self.limit_source)
        return Setup(*facts, self.reserve_bytes, Traits(), None, (*self.notes,))

    def close(self, trials: Sequence[Trial], answer: GroupAnswer | None, exc: BaseException | None) -> Findings:
        """Nothing to undo (each job ended with its trial): what the jobs said."""
        reused = [f"{self.reused} trial(s) were reused from the trial log {self.log}"] if self.reused else []
        jobs = (
            f"every trial ran as a fresh job of {self.ranks.world_size} ranks ({self.jobs} job(s) started): the "
            "model's own collectives ran as in training, and a rank that ran out of memory ended its job"
        )
        said = (*reused, *ranks_notes(self.ranks.world_size, [jobs]))  # no meter, no compilation said back
        return Findings(said, self._facts.get("fixed_advice"))

    # trials ----------------------------------------------------------------------------------------
    def run(self, request: TrialRequest) -> Trial:
        """One trial: the first job's when it asked the same, else from the log when it holds one,
        else a job (each rank under ``request.cap_bytes`` when given)."""
        first, self._first = self._first, None
        batch_size, kind, cap_bytes = request.batch_size, request.kind, request.cap_bytes
        steps = request.steps or self.options.steps_per_trial or FRESH_STEPS
        if first is not None and first[0] == (batch_size, kind, steps, cap_bytes):
            return first[1]
        return replace(self._logged_or_run(batch_size, steps, cap_bytes, None)[0], kind=kind)

    def _logged_or_run(
        self, batch_size: int, steps: int, cap_bytes: int | None, headroom: float | None
    ) -> tuple[Trial, int | None]:
        """The trial from the log, else from a job, logged; and the cap it ran under: ``cap_bytes``,
        or with ``headroom`` each rank's own budget less it (``None`` when the ranks' caps differ)."""
        verdicts = self._from_log(batch_size, steps, cap_bytes, headroom)
        ran = verdicts is None
        if verdicts is None:
            verdicts = self._run_job(batch_size, steps, cap_bytes, headroom)
        else:
            self.reused += 1
        trial = self._combine(batch_size, verdicts)
        cap = cap_bytes
        if headroom is not None:  # each rank capped itself: the group's cap when every rank had the same one
            group = None if self.budget_bytes is None else safe_cap(self.budget_bytes, headroom)
            cap = group if {v.get("cap_bytes") for v in verdicts.values()} == {group} else None
        if ran:
            self._append_log(batch_size, steps, verdicts, cap, headroom)
        return trial, cap

    def _combine(self, batch_size: int, verdicts: dict[int, dict[str, Any]]) -> Trial:
        raise_failure(batch_size, verdicts, self.ranks.world_size)
        facts = verdicts[min(verdicts)]
        self._facts = facts
        budgets = [v["budget_bytes"] for v in verdicts.values() if v.get("budget_bytes") is not None]
        self.budget_bytes = min(budgets) if budgets else None
        self.counts = facts["counts"]
        self.device_info = DeviceInfo.from_dict(facts["device"])
        self.limit_bytes, self.limit_source = facts["limit_bytes"], facts["limit_source"]
        self.reserve_bytes = facts["reserve_bytes"]
        trials = {rank: Trial.from_dict(v["trial"]) for rank, v in verdicts.items()}
        failed = sorted(rank for rank, t in trials.items() if not t.fits)
        if not failed and batch_size >= self._state[0]:
            self._state = (batch_size, facts)
        out_of_memory = (failed[0], trials[failed[0]].message or "") if failed else None
        # What a trial left allocated dies with its job: it cannot weigh on the next trial (FSDP
        # keeps the root's unsharded parameters after forward, which would read as a leak).
        return replace(combine_trials([trials[rank] for rank in sorted(trials)], out_of_memory), leaked_bytes=0)

    # the job ---------------------------------------------------------------------------------------
    def _run_job(
        self, batch_size: int, steps: int, cap_bytes: int | None = None, headroom: float | None = None
    ) -> dict[int, dict[str, Any]]:
        """Start the job, wait for a decision (every rank fitted, or the first failure), and kill
        whatever is left of the job."""
        self.jobs += 1
        world_size = self.ranks.world_size
        with tempfile.TemporaryDirectory(prefix="batchfit-trial-") as folder:
            out = Path(folder)
            request = replace(
                self.request, out=str(out), batch_size=batch_size, steps=steps, cap_bytes=cap_bytes, headroom=headroom
            )
            request.write(out / "request.json")
            command = worker_command(out / "request.json", world_size)
            # From the job's start on (a Ctrl-C while Popen starts it too), every way out kills it whole.
            with (
                open(out / "stderr.txt", "w") as stderr,
                in_session(
                    command, partial(end_torchrun, out=out), stdout=subprocess.DEVNULL, stderr=stderr, env=worker_env()
                ) as job,
            ):
                return self._wait(job, out, batch_size)

    def _wait(self, job: subprocess.Popen[bytes], out: Path, batch_size: int) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + self.timeout_s
        world_size = self.ranks.world_size
        while True:
            exited = job.poll() is not None
            verdicts = read_verdicts(out)
            if any("error" in v or not v["trial"]["fits"] for v in verdicts.values()) or len(verdicts) == world_size:
                return verdicts
            if exited:
                missing = sorted(set(range(world_size)) - set(verdicts))
                tail = (out / "stderr.txt").read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"the trial job at batch size {batch_size} ended (exit code {job.returncode}) without an answer "
                    f"from rank(s) {', '.join(map(str, missing))}; its output ended with:\n{tail}"
                )
            if time.monotonic() > deadline:
                raise RanksTimeoutError(
                    f"the trial job at batch size {batch_size} gave no answer within --trial-timeout "
                    f"{self.timeout_s:g} s (ranks that answered: {sorted(verdicts) or 'none'}); it was killed"
                )
            time.sleep(0.05)

    # the log ---------------------------------------------------------------------------------------
    def _read_log(self) -> list[dict[str, Any]]:
        """This search's jobs in the log, each checked (`batchfit.probe.cache_files.read_trial_log`)."""
        if self.log is None:
            return []
        logged = read_trial_log(self.log, self.key, self.ranks.world_size)
        self.notes += logged.notes
        return list(logged.jobs)

    def _from_log(
        self, batch_size: int, steps: int, cap_bytes: int | None, headroom: float | None
    ) -> dict[int, dict[str, Any]] | None:
        """The verdicts of a logged job with the same settings, size and steps, run under the same
        cap (``cap_bytes``), or the same ``headroom`` off each rank's budget."""
        for entry in reversed(self._logged):
            same = entry["key"] == self.key and entry["batch_size"] == batch_size and entry["steps"] == steps
            ran_under = entry.get("headroom") if headroom is not None else entry.get("cap_bytes")
            if same and ran_under == (headroom if headroom is not None else cap_bytes):
                if headroom is not None or cap_bytes is not None or entry.get("headroom") is None:
                    return {int(rank): verdict for rank, verdict in entry["ranks"].items()}
        return None

    def _append_log(
        self,
        batch_size: int,
        steps: int,
        verdicts: dict[int, dict[str, Any]],
        cap_bytes: int | None = None,
        headroom: float | None = None,
    ) -> None:
        entry = {
            "schema": TRIAL_LOG_SCHEMA,
            "key": self.key,
            "batch_size": batch_size,
            "steps": steps,
            "cap_bytes": cap_bytes,
            "headroom": headroom,
            "ranks": {str(rank): verdict for rank, verdict in verdicts.items()},
        }
        self._logged.append(entry)
        if self.log is not None:
            append_line(self.log, json.dumps(entry, sort_keys=True))

    # what find() asks of a probe --------------------------------------------------------------------
    def settle(self, trials: Sequence[Trial]) -> Settled:
        """The budget (each job measures its own reserve when it starts: its context is fresh), and
        the memory equation with the state the largest completed job said a rank holds."""
        facts = self._state[1]
        weights, trainable = facts.get("weights_bytes", 0), facts.get("trainable_bytes", 0)
        state = facts.get("optimizer_state_bytes", 0)
        memory = fit_memory(list(trials), weights, trainable, self.options.mode, state, self.counts, self.budget_bytes)
        return Settled(self.budget_bytes, self.limit_bytes, self.limit_source, self.reserve_bytes, memory)

    def state_bytes(self) -> int:
        """What a rank holds whatever the batch, as its jobs said: its shards of the weights, of the
        gradients (training) and of the optimizer state."""
        facts = self._state[1]
        trainable = facts.get("trainable_bytes", 0) if self.options.mode == "train" else 0
        return int(facts.get("weights_bytes", 0) + trainable + facts.get("optimizer_state_bytes", 0))
