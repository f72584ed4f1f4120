"""``batchfit probe TARGET --buckets LENGTHS``: batch sizes for variable-length data.

Runs [`batchfit.buckets`][batchfit.buckets] with the target's model and its ``make_batch(batch_size,
seq_len)`` (or, with ``--buckets dataset`` or a target without one, its ``DataLoader`` whose
dataset declares lengths) over the lengths ``LENGTHS`` names (`batchfit.cli.lengths_arguments`),
with the probe's memory, headroom, optimizer and search flags. It shows a row per measured length
(``batchfit.view.frontier_view``), then the plan as ``str(plan)`` prints it: the buckets' table,
the token budget's compositions, packing, the soaks and each framework's knobs; ``--quiet`` one
line of ``key=value``; ``--json`` the plan's document (schema ``batchfit.lengths/1``).

``--soak`` replays an epoch of each sampler the plan feeds (`batchfit.api_varlen.epoch_samplers`)
in a fresh process per sampler ([`batchfit.soak`][batchfit.soak] given the target string), as a
training run starts; a target whose batches come from its loader (no ``make_batch`` for that
process to take) soaks in this process instead (``verify="epoch"``).

With ``--token-budget`` the token budget is the answer: its line comes first, ``--quiet`` leads
with it, and a plan without one (no padded budget holds the longest row) does not fit.

Exit codes as the probe's (``batchfit.cli``): 0 ok; 1 error; 2 usage or bad target (a LENGTHS
file missing or holding a non-length, a flag ``--buckets`` does not take, a target with neither
``make_batch`` nor a loader that declares lengths, a length past the model's positions, packing
of a model without ``position_ids``: all before the first trial); 3 does not fit: not even batch 1
at the longest length, a ``--soak`` step that ran out of memory (as the gate fails: the plan is
printed and ``--json`` written first), or ``--token-budget`` without a budget; 130, 141, 143.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any, TextIO

import batchfit.api_varlen as api_varlen  # buckets through its module: a patch of it there is seen
from batchfit.backends import default_device
from batchfit.cli.arguments import limit_lines, option_keywords
from batchfit.cli.frontier_command import lengths_batches
from batchfit.cli.lengths_arguments import DATASET, WITH_BUCKETS, read_lengths
from batchfit.cli.output import (
    EXIT_DOES_NOT_FIT,
    EXIT_OK,
    HeldOutput,
    UsageError,
    check_json_path,
    error,
    load,
    write_json,
)
from batchfit.cli.probe import Calls, probe_failed, run_shown
from batchfit.distributed import from_environment
from batchfit.probe import is_batch_source
from batchfit.probe.keywords import FindOptions, FrontierOptions, keywords_of
from batchfit.report import FrontierPoint, LengthPlan
from batchfit.report.bucketing import candidate_lengths, histogram_of
from batchfit.targets import Target
from batchfit.units import format_bytes
from batchfit.version import __version__
from batchfit.view.frontier_view import FrontierView

#: ``probe``'s flags that ``--buckets`` has no use for (their ``args`` names), refused when given:
#: the gate, the jobs of ``--nproc-per-trial``, ``torchrun``'s per-rank limits, a single probe's
#: plan and extras, and `find`'s options that `batchfit.buckets` does not take (the data's own
#: length, a loader's scan, the answer's extras).
REFUSED = (
    "require_batch",
    "nproc_per_trial",
    "trial_log",
    "guess",
    "no_estimate",
    "target_batch",
    "target_tokens",
    "memory_limit_per_rank",
    "uneven",
    "compare_expandable",
    *(name for name in keywords_of(FindOptions) if name not in keywords_of(FrontierOptions)),
)

#: `batchfit.buckets`' default ``max_buckets``, when ``--max-buckets`` is not given (its help says it too).
DEFAULT_MAX_BUCKETS: int = inspect.signature(api_varlen.buckets).parameters["max_buckets"].default


def buckets_command(args: argparse.Namespace) -> int:
    check_bucket_options(args)
    check_json_path(args.json)
    lengths = read_lengths(args.buckets)  # a bad file costs nothing: before the target loads
    device, limit, header, ends = buckets_plan(args, lengths)
    loaded = load(args, lengths=lengths is not DATASET)
    if isinstance(loaded, int):
        return loaded
    batches, header_notes = batch_source(loaded, lengths)
    # what crosses into a fresh soak's process as JSON; the target's own keywords are loaded there again
    crossing: dict[str, Any] = {**option_keywords(args, FrontierOptions), "device": device, "memory_limit": limit}
    kwargs = {**{key: value for key, value in loaded.extras.items() if key != "make_batch"}, **crossing}
    human = sys.stderr if args.json == "-" else sys.stdout
    view = BucketsView(human, quiet=args.quiet, pack_length=args.pack_length)
    calls = Calls(view)  # type: ignore[arg-type]  # the view takes a probe's callbacks too

    fresh = args.soak and lengths is not DATASET and batches is not loaded.sample  # the target's make_batch

    def run() -> LengthPlan:
        view.start([*header, *header_notes], ends)
        plan = api_varlen.buckets(
            loaded.model,
            batches,
            lengths=None if lengths is DATASET else lengths,
            max_buckets=args.max_buckets if args.max_buckets is not None else DEFAULT_MAX_BUCKETS,
            token_budget=not args.no_token_budget,
            pack_length=args.pack_length,
            world_size=args.world_size or 1,
            verify="epoch" if args.soak and not fresh else None,
            soak_steps=args.soak_steps,
            on_point=view.point_finished,
            **calls.kwargs(),
            **kwargs,
        )
        if fresh:  # the options cross as JSON; the target's code is loaded again there
            for name, sampler in api_varlen.epoch_samplers(plan, histogram_of(lengths)):
                soaked = api_varlen.soak(loaded.spec, None, sampler, name=name, max_steps=args.soak_steps, **crossing)
                plan = plan.with_soak(soaked)
        return plan

    with HeldOutput() as held:  # a library's warnings would split the table: shown once, at the end
        plan, failure = run_shown(view, run)
    if failure is not None:
        held.show(sys.stderr)
        return probe_failed(failure, calls, args.traceback)
    show_plan(plan, human, quiet=args.quiet, budget_first=args.token_budget)
    held.show(sys.stderr)
    if args.json:
        write_json(args.json, plan.to_json())
    return verdict(plan, budget_asked=args.token_budget)


def check_bucket_options(args: argparse.Namespace) -> None:
    """The flags that go with ``--buckets``, checked before anything loads (a usage error each)."""
    if args.buckets is None:
        given = next(name for name in WITH_BUCKETS if getattr(args, name) not in (None, False))
        raise UsageError(f"--{flag(given)} goes with --buckets LENGTHS (the data's lengths)")
    for name in REFUSED:
        if getattr(args, name, None) not in (None, False):
            raise UsageError(f"--{flag(name)} is not an option of --buckets (which sizes the data's lengths): drop it")
    if args.token_budget and args.no_token_budget:
        raise UsageError("--token-budget asks for the token budget and --no-token-budget leaves it out: give one")
    if args.soak_steps is not None and not args.soak:
        raise UsageError("--soak-steps goes with --soak")
    try:
        launch = from_environment()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if launch is not None:
        raise UsageError("--buckets runs in one process: run it without torchrun (--world-size N counts the ranks)")


def flag(name: str) -> str:
    return name.replace("_", "-")


def buckets_plan(args: argparse.Namespace, lengths: Any) -> tuple[str, str | None, list[str], tuple[int, ...]]:
    """The device, the memory limit, the header lines, and the candidate bucket ends the view
    counts (``()`` for the lengths a loader declares: read once it is loaded)."""
    device = args.device or default_device()
    if lengths is DATASET:
        said, ends = "the lengths the target's dataset declares", ()
    else:
        histogram = histogram_of(lengths)
        rows = sum(histogram.values())
        said = f"{rows:,} rows of {min(histogram):,}-{max(histogram):,} tokens from {args.buckets}"
        ends = candidate_lengths(histogram, args.multiple_of or 1)
    header = [f"batchfit {__version__}: buckets for {args.target} ({args.mode}) on {device}: {said}"]
    limit, lines, _ = limit_lines(device, args.memory_limit, bool(args.device), args.reserve)
    return device, limit, header + lines, ends


def batch_source(target: Target, lengths: Any) -> tuple[Any, list[str]]:
    """What builds the batches (the target's ``make_batch``, else its loader) and header notes;
    a `UsageError` naming what the target lacks."""
    if lengths is DATASET:
        if not is_batch_source(target.sample):
            given = "no sample" if target.sample is None else f"a {type(target.sample).__name__} as its sample"
            raise UsageError(
                f"--buckets dataset reads the lengths a DataLoader's dataset declares, and {target.spec} gives "
                f"{given}: return a DataLoader whose dataset has `lengths` as the sample, or give --buckets a "
                "file of lengths"
            )
        notes = []
        if target.unused == "make_batch":
            notes.append("the target's make_batch is not used: --buckets dataset sizes the loader's own items")
        return target.sample, notes
    make_batch = lengths_batches(target, "batchfit probe --buckets")
    if make_batch is not None:
        return make_batch, []
    if is_batch_source(target.sample):
        return target.sample, ["no make_batch: the batches are the loader's longest item, cut to each length"]
    given = "no sample" if target.sample is None else f"a {type(target.sample).__name__} as its sample"
    raise UsageError(
        f"{target.spec} gave no make_batch(batch_size, seq_len) and {given}, not a DataLoader whose dataset "
        "declares lengths: --buckets builds each bucket's batches at its length; return a mapping with "
        "'model' and 'make_batch'"
    )


class BucketsView(FrontierView):
    """The frontier's view, told what the trials after the candidate lengths are: the token
    budget's compositions, then packed rows (the frontier's own view would call them the search
    for the longest length at batch 1)."""

    def __init__(self, stream: TextIO, *, quiet: bool, pack_length: int | None, plain: bool | None = None) -> None:
        self.after = "the token budget's compositions" + ("; packed rows" if pack_length else "")
        self.ends = 0  # set before the frontier's view: a terminal's live display renders at once
        self.measured = 0
        super().__init__(stream, quiet=quiet, plain=plain)

    def start(self, header: Any, seq_lens: Any = ()) -> None:
        self.ends = len(set(seq_lens))
        super().start(header, seq_lens)

    def point_finished(self, point: FrontierPoint) -> None:
        self.measured += 1
        super().point_finished(point)

    def current_length(self) -> str:
        if self.ends and self.measured >= self.ends:
            return self.after
        return super().current_length()


def show_plan(plan: LengthPlan, stream: TextIO, *, quiet: bool, budget_first: bool) -> None:
    """The plan: ``str(plan)`` (after the token budget's line with ``budget_first``), or one line."""
    if quiet:
        print(quiet_line(plan, budget_first), file=stream)
        return
    lines = [""]
    if budget_first:
        lines += [budget_line(plan), ""]
    lines += str(plan).splitlines()
    stream.write("\n".join(lines) + "\n")
    stream.flush()


def budget_line(plan: LengthPlan) -> str:
    """``--token-budget``'s answer in a line: the budget, where it binds, what proved it."""
    budget = plan.token_budget
    if budget is None:
        why = next((note for note in plan.notes if "token budget" in note), "none was found")
        return f"token budget: none: {why}"
    fits = sum(c.fits for c in budget.compositions)
    return (
        f"token budget: max_tokens={budget.max_tokens:,} per rank (rows x longest row), binds at length "
        f"{budget.binding_length:,}; {fits} of {len(budget.compositions)} worst compositions fit"
    )


def quiet_line(plan: LengthPlan, budget_first: bool) -> str:
    """``--quiet``'s one line, ``key=value`` for scripts (the token budget first with ``budget_first``)."""
    budget = [] if plan.token_budget is None else [f"max_tokens={plan.token_budget.max_tokens}"]
    buckets = [
        f"boundaries={','.join(map(str, plan.boundaries))}",
        f"batch_sizes={','.join(map(str, plan.batch_sizes))}",
        f"epoch_steps={plan.epoch_steps}",
        f"padding={plan.padding:.3f}",
    ]
    if plan.tokens_per_s is not None:
        buckets.append(f"tokens_per_s={plan.tokens_per_s:.0f}")
    packing = []
    if plan.packing is not None:
        packing = [f"pack_length={plan.packing.pack_length}", f"packed_batch={plan.packing.batch_size}"]
        if plan.best_layout is not None:
            packing.append(f"best={plan.best_layout}")
    soaks = [f"soak_oom={sum(soak.oom for soak in plan.soaks)}"] if plan.soaks else []
    parts = [*budget, *buckets] if budget_first else [*buckets, *budget]
    return " ".join([*parts, *packing, *soaks])


def verdict(plan: LengthPlan, *, budget_asked: bool) -> int:
    """0, or 3 (does not fit, said on stderr) for a soak step that ran out of memory, or for
    ``--token-budget`` without a budget."""
    code = EXIT_OK
    for soak in plan.soaks:
        if soak.oom:
            error(
                f"the soak of the {soak.sampler} sampler ran out of memory at {soak.oom:,} of {soak.steps:,} steps "
                f"(peak {format_bytes(soak.peak_bytes)} at step {soak.peak_step:,}, "
                f"{soak.peak_shape[0]:,} x {soak.peak_shape[1]:,})"
            )
            code = EXIT_DOES_NOT_FIT
    if budget_asked and plan.token_budget is None:
        error(budget_line(plan).replace("token budget: none: ", "no token budget: ", 1))
        code = EXIT_DOES_NOT_FIT
    return code
