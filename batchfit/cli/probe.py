"""``batchfit probe TARGET``: one probe (of this process, or of this rank of a ``torchrun`` job),
the gate (``--require-batch``), or a probe whose trials are torchrun jobs (``--nproc-per-trial``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import batchfit.probe as probe_surface  # find_with through its module: a patch of it there is seen
from batchfit.api_jobs import find_sharded
from batchfit.cli.allocators import advised, expandable_note
from batchfit.cli.arguments import find_kwargs, probe_plan
from batchfit.cli.flags import rank_wait_s
from batchfit.cli.output import (
    EXIT_DOES_NOT_FIT,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_USAGE,
    RESTORED,
    HeldOutput,
    UsageError,
    check_json_path,
    check_noise_options,
    check_plan_options,
    error,
    load,
    noise_source_problem,
    plan_line,
    recommendation_lines,
    report_exception,
    write_json,
)
from batchfit.cli.signals import SigtermUnwinds, Terminated
from batchfit.distributed import Launch, from_environment
from batchfit.errors import NothingFitsError, RankFailedError, first_line
from batchfit.probe import Options
from batchfit.targets import Target, exit_call
from batchfit.testing import check_fits
from batchfit.view.plain import OutputClosedError, View, fit_lines
from batchfit.view.progress import columns, make_view

# probe --------------------------------------------------------------------------------------------


def probe_command(args: argparse.Namespace) -> int:
    try:
        launch = from_environment()
    except ValueError as exc:  # a job whose rank cannot be placed
        raise UsageError(str(exc)) from None
    if args.nproc_per_trial is not None:
        if launch is not None:
            raise UsageError("--nproc-per-trial starts a torchrun job per trial itself: run it without torchrun")
        if args.require_batch is not None:
            raise UsageError("--nproc-per-trial runs a full probe: drop --require-batch")
        if args.cache is not None:  # each trial is a job of its own: no probe in this process to key
            raise UsageError("--cache keeps a probe of this process (or of torchrun's ranks): drop it here")
    else:
        given = [flag for flag, value in (("trial-log", args.trial_log), ("guess", args.guess)) if value is not None]
        if given or args.no_estimate:
            raise UsageError(f"--{given[0] if given else 'no-estimate'} goes with --nproc-per-trial")
    check_plan_options(args)
    check_noise_options(args)
    check_rank_options(args)
    if launch is None:
        return probe_here(args, None)
    owned: list[bool] = []
    try:
        return probe_here(args, launch, owned)
    finally:
        launch.finish(bool(owned and owned[0]))


def check_rank_options(args: argparse.Namespace) -> None:
    """``--uneven`` and ``--memory-limit-per-rank``, refused where they would do nothing, before
    anything loads: ``--uneven`` splits the recommendation, which only a full training probe
    prints (not ``--quiet``'s line or the gate's); per-rank limits are for the ranks of one
    ``torchrun`` probe, not for a job per trial, whose ranks all take one limit."""
    if args.uneven:
        if args.require_batch is not None:
            raise UsageError("--uneven splits the recommendation, which the gate (--require-batch) does not give")
        if args.quiet:
            raise UsageError("--uneven splits the recommendation, which --quiet leaves out: drop one of them")
        if args.mode != "train":
            raise UsageError(f"--uneven splits a batch to train with; --mode {args.mode} recommends none")
    if args.memory_limit_per_rank and args.nproc_per_trial is not None:
        raise UsageError(
            "--memory-limit-per-rank is for the ranks of one probe under torchrun; the jobs of --nproc-per-trial "
            "take one --memory-limit for every rank"
        )


def probe_here(args: argparse.Namespace, launch: Launch | None, owned: list[bool] | None = None) -> int:
    """One probe: of this process, or of this rank of a ``torchrun`` job (``launch``; ``owned``
    gets whether this process started the process group)."""
    if args.require_batch is not None:
        conflicting = [
            name for name in ("max_batch", "verify_steps", "time_budget", "cache") if getattr(args, name) is not None
        ]
        if conflicting:
            raise UsageError(
                f"--require-batch runs a gate, not a full probe: drop --{conflicting[0].replace('_', '-')}"
            )
    check_json_path(args.json)
    device, limit, header, expected_budget = probe_plan(args, launch)
    backend = ""
    if launch is not None:
        # The group first: a target's factory may need it (fully_shard, a rank-dependent build).
        try:
            backend, started = launch.start(device, rank_wait_s(args))
        except Exception as exc:
            report_exception(exc, args.traceback, cause=False, text=f"cannot join the ranks: {first_line(exc)}")
            return EXIT_ERROR
        if owned is not None:
            owned.append(started)
    target: Target | None = None
    if args.nproc_per_trial is None:  # with it, only the ranks of each job load the target
        loaded = load(args)
        if isinstance(loaded, int):
            return loaded
        target = loaded
        problem = noise_source_problem(target) if args.noise_scale else None
        if problem is not None:  # before the probe: found out after it, it would cost the whole probe
            error(problem)
            return EXIT_USAGE
        unused = target.unused_note("probe")
        if unused is not None:
            header.append(unused)

    human = sys.stderr if args.json == "-" else sys.stdout
    leader = launch is None or launch.is_leader
    if launch is not None and target is not None:
        try:
            model, wrapped = launch.wrap(target.model, device)
        except Exception as exc:
            report_exception(exc, args.traceback, cause=False, text=f"cannot join the ranks: {first_line(exc)}")
            return EXIT_ERROR
        target = replace(target, model=model)
        header.append(
            f"torchrun: rank {launch.rank} of {launch.world_size} ({backend}); the model "
            + ("was wrapped in DistributedDataParallel" if wrapped else "was left as the target built it")
            + "; batch sizes are per rank"
        )
    if args.nproc_per_trial is not None:
        header.append(
            f"every trial runs as a fresh torchrun job of {args.nproc_per_trial} ranks (--nproc-per-trial)"
            + (f"; trial log {args.trial_log}" if args.trial_log else "")
        )
    # Only rank 0 speaks for the group; the others print only their own errors.
    view = make_view(human if leader else open(os.devnull, "w"), quiet=args.quiet or not leader)
    kwargs = find_kwargs(args, target, device, limit)
    calls = Calls(view)

    def probe() -> Any:
        view.start(header, expected_budget)
        outcome = run_probe(args, target, kwargs, calls)
        view.set_budget(outcome.budget_bytes)  # the budget the probe really had, for the final frame
        return outcome

    with HeldOutput() as held:  # a library's warnings would split the table: shown once, at the end
        outcome, failure = run_shown(view, probe)
    if failure is not None:
        if leader:
            held.show(sys.stderr)
        return probe_failed(failure, calls, args.traceback, leader)
    if args.require_batch is not None:
        view.gate(outcome)
        code = EXIT_OK if outcome.fits else EXIT_DOES_NOT_FIT
    else:
        if launch is None and (args.compare_expandable or advised(outcome)):
            outcome = replace(outcome, notes=(*outcome.notes, expandable_note(args.argv, outcome)))
        view.summary(outcome)
        code = EXIT_OK
        if leader:
            targets = {"target_tokens": args.target_tokens, "seq_len": args.seq_len, "world_size": args.world_size}
            lines: list[str] = []
            if args.target_batch is not None or args.target_tokens is not None:
                lines.append(plan_line(outcome, args.target_batch, **targets))
            # --quiet keeps its one line; the recommendation is in --json too. It is a batch to train
            # with: a probe of inference, evaluation or generation has its safe batch as its answer.
            if not args.quiet and outcome.settings.mode == "train":
                lines += recommendation_lines(outcome, args.target_batch, **targets, uneven=args.uneven)
            # Within COLUMNS as the view's lines are; --quiet's lines stay whole, for scripts.
            for line in lines:
                for part in fit_lines(line, None if args.quiet else columns(), 17):
                    print(part, file=human)
    if leader:
        held.show(sys.stderr)
    if args.json and leader:
        write_json(args.json, outcome.to_json())
    return code


def run_jobs(args: argparse.Namespace, kwargs: dict[str, Any], callbacks: dict[str, Any]) -> Any:
    """The search whose trials are jobs: [`find_sharded`][batchfit.find_sharded]'s, one path for both."""
    return find_sharded(
        args.target,
        args.nproc_per_trial,
        trial_log=args.trial_log,
        trial_timeout=args.trial_timeout,
        guess=args.guess,
        estimate=not args.no_estimate,
        **kwargs,
        **callbacks,
    )


def run_shown(view: Any, run: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``run()``'s answer, or what ended it (Ctrl-C and SIGTERM too), with the live ``view``
    taken down either way (on a terminal this gives the cursor back). A SIGTERM delivered as the
    Ctrl-C that unwound the run, or that came as it returned, is a `Terminated`."""
    answer: Any = None
    failure: BaseException | None = None
    with SigtermUnwinds() as sigterm:
        try:
            try:
                answer = run()
            except BaseException as exc:  # Ctrl-C and SIGTERM too: the view comes down either way
                failure = exc
        finally:
            sigterm.hold()
            view.stop()
    if sigterm.received and (failure is None or type(failure) is KeyboardInterrupt):
        failure = Terminated()
    return answer, failure


def run_probe(args: argparse.Namespace, target: Target | None, kwargs: dict[str, Any], calls: Calls) -> Any:
    """The gate (``--require-batch``) or the full search; its ``GateReport`` or ``Result``.
    Without a target (``--nproc-per-trial``), a job per trial (``batchfit.probe.job_runner``)."""
    if target is None:
        return run_jobs(args, kwargs, calls.kwargs())
    if args.require_batch is not None:
        return check_fits(target.model, target.sample, batch_size=args.require_batch, **calls.kwargs(), **kwargs)
    return probe_surface.find_with(target.model, target.sample, Options(**kwargs), **calls.kwargs())


class Calls:
    """Forwards ``find()``'s callbacks to the view and remembers the trial in flight: whether
    one started tells a rejected input (usage) from an error inside the user's model, and which
    one it was says where the user's code called ``sys.exit()``."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.started = False
        self.current: tuple[int, str] | None = None  # (batch size, kind) of the last trial started

    def on_trial_start(self, batch_size: int, kind: str) -> None:
        self.started = True
        self.current = (batch_size, kind)
        self.view.trial_started(batch_size, kind)

    def on_start(self, device: Any, budget_bytes: int | None) -> None:
        self.view.set_budget(budget_bytes)

    def kwargs(self) -> dict[str, Any]:
        return {"callback": self.view.trial_finished, "on_trial_start": self.on_trial_start, "on_start": self.on_start}


def probe_failed(exc: BaseException, calls: Calls, show_traceback: bool, leader: bool = True) -> int:
    """The exit code (and the one line) for whatever ended a probe that had started. Under
    ``torchrun`` another rank's failure is told by rank 0 (and by the failing rank) only."""
    if isinstance(exc, RankFailedError) and not leader:
        return EXIT_ERROR
    if isinstance(exc, Terminated):
        if exc.forced:
            error("terminated by a second SIGTERM, at once: the model and optimizer may not have been restored")
        else:
            error(f"terminated by SIGTERM ({RESTORED})")
        return EXIT_TERMINATED
    if isinstance(exc, KeyboardInterrupt):
        error(f"interrupted ({RESTORED})")
        return EXIT_INTERRUPTED
    if isinstance(exc, OutputClosedError):  # our reader left: main() exits quietly
        raise exc
    if isinstance(exc, SystemExit):  # the user's code, in a trial: an error, not batchfit's exit code
        where = "during the probe"
        if calls.current is not None:
            batch_size, kind = calls.current
            where = f"during a {kind} trial at batch size {batch_size}"
        report_exception(exc, show_traceback, cause=False, text=f"the target called {exit_call(exc)} {where}")
        return EXIT_ERROR
    if isinstance(exc, NothingFitsError):
        error(str(exc))
        return EXIT_DOES_NOT_FIT
    if isinstance(exc, (TypeError, ValueError)) and not calls.started:
        # find() checks its input before the first trial: what it rejects there is the target's
        # sample or model, or an option (a device that is not there), not a failure of a run.
        error(f"{first_line(exc)}")
        return EXIT_USAGE
    if not isinstance(exc, Exception):
        raise exc
    report_exception(exc, show_traceback, cause=False)
    return EXIT_ERROR
