"""``batchfit fit TARGET --target-batch N``: the activation-checkpointing policy that trains N fastest.

A command of its own rather than ``probe --checkpointing``: it runs [`batchfit.fit`][batchfit.fit], whose
answer is another document (a `Fit`, a row per policy, schema ``batchfit.fit/1``) and whose contract
is not `find`'s (a target batch is required; one process; training only), as ``frontier`` runs
`batchfit.frontier`. The probe's flags mean the same here, read by the same code
(`batchfit.cli.arguments`, validated by [`Options`][batchfit.Options]); the flags of what `fit`
refuses (``--mode``, ``--eval``, ``--cache``, ``--noise-scale``) are not offered
(``batchfit.cli.parser.FIT_REFUSES``). The trials show as a
probe's do; then the policy table `str(fit)` prints (``batchfit.report.checkpointing_text``).

Exit codes as the probe's (``batchfit.cli``): 0 ok, 1 error, 2 usage or bad target (no repeated
blocks, a block name that is no module: before the first trial), 3 does not fit (not even the
smallest batch, or with ``--no-accumulate`` no policy fits the target in one step), 130 Ctrl-C,
141 stdout closed, 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from batchfit.api import fit
from batchfit.backends import default_device
from batchfit.cli.arguments import limit_lines, option_keywords
from batchfit.cli.frontier_command import check_plot_path
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
from batchfit.probe.keywords import FindOptions
from batchfit.report import Fit
from batchfit.version import __version__
from batchfit.view.progress import make_view

#: How `batchfit.fit` begins the error it raises when, without accumulation, no policy fits the
#: target in one step: a "does not fit" (exit 3), not an error of the run.
NO_POLICY_FITS = "no policy fits target_batch"


def fit_command(args: argparse.Namespace) -> int:
    try:
        launch = from_environment()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if launch is not None:  # fit() refuses distributed=True: say so before any rank loads a model
        raise UsageError("batchfit fit sizes one process: run it without torchrun (on one rank's device)")
    check_json_path(args.json)
    check_plot_path(args.plot)
    device, limit, header, expected = fit_plan(args)
    loaded = load(args)
    if isinstance(loaded, int):
        return loaded
    unused = loaded.unused_note("fit")
    if unused is not None:
        header.append(unused)
    human = sys.stderr if args.json == "-" else sys.stdout
    view = make_view(human, quiet=args.quiet)
    calls = Calls(view)
    kwargs: dict[str, Any] = {
        **loaded.extras,
        **option_keywords(args, FindOptions),
        "device": device,
        "memory_limit": limit,
    }

    def run() -> Fit:
        view.start(header, expected)
        return fit(
            loaded.model,
            loaded.sample,
            target_batch=args.target_batch,
            checkpointing=args.checkpointing,
            placement=args.placement,
            accumulate=not args.no_accumulate,
            **kwargs,
            **calls.kwargs(),
        )

    with HeldOutput() as held:  # a library's warnings would split the table: shown once, at the end
        answer, failure = run_shown(view, run)
    if failure is not None:
        held.show(sys.stderr)
        if isinstance(failure, ValueError) and str(failure).startswith(NO_POLICY_FITS):
            error(str(failure))
            return EXIT_DOES_NOT_FIT
        return probe_failed(failure, calls, args.traceback)
    print(quiet_line(answer) if args.quiet else f"\n{answer}", file=human)
    held.show(sys.stderr)
    if args.json:
        write_json(args.json, answer.to_json())
    if args.plot:
        try:
            answer.plot(args.plot)
        except OSError as exc:  # after the run: its table is already shown
            raise UsageError(f"cannot write --plot {args.plot!r}: {exc.strerror or exc}") from None
        if not args.quiet:
            print(f"plot written to {args.plot}", file=human)
    return EXIT_OK


def fit_plan(args: argparse.Namespace) -> tuple[str, str | None, list[str], int | None]:
    """The device, the memory limit, the header lines and the budget known before the probe (as a probe's)."""
    device = args.device or default_device()
    accumulation = "" if not args.no_accumulate else ", in one step"
    header = [
        f"batchfit {__version__}: fitting {args.target} to a target batch of {args.target_batch}{accumulation} "
        f"on {device}: which blocks to checkpoint"
    ]
    limit, lines, expected = limit_lines(device, args.memory_limit, bool(args.device), args.reserve)
    return device, limit, header + lines, expected


def quiet_line(fit: Fit) -> str:
    """``--quiet``'s one line: ``checkpointed=3/12 micro_batch=64 accumulation=1 target_batch=64 samples_per_s=8.5``."""
    policy, rec = fit.policy, fit.recommendation
    if policy.budget is not None:
        chosen = f"compile_budget={policy.budget:g}"
    else:
        chosen = f"checkpointed={policy.k}/{policy.blocks}"
    rate = fit.rows[fit.chosen].samples_per_s
    shown = "" if rate is None else f" samples_per_s={rate:.1f}"
    split = f"micro_batch={rec.batch_size} accumulation={rec.accumulation} target_batch={fit.target_batch}"
    return f"{chosen} {split}{shown}"
