"""``batchfit estimate TARGET --memory SIZE``: the probe's answer for a memory size, on fake tensors."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from batchfit.cli.output import (
    EXIT_DOES_NOT_FIT,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    check_json_path,
    error,
    load,
    plan_line,
    report_exception,
    write_json,
)
from batchfit.errors import first_line
from batchfit.version import __version__


def estimate_command(args: argparse.Namespace) -> int:
    from batchfit.backends import DEFAULT_ESTIMATE_TARGET, estimate_target
    from batchfit.errors import NothingFitsError
    from batchfit.estimation import OPTIONS, estimate, what_if
    from batchfit.view import make_view

    for option in args.what_if or ():
        if option not in OPTIONS:
            raise UsageError(f"unknown --what-if {option!r}: choose from {', '.join(OPTIONS)}")
    args.device = args.device or DEFAULT_ESTIMATE_TARGET
    try:
        estimate_target(args.device)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    check_json_path(args.json)
    human = sys.stderr if args.json == "-" else sys.stdout
    target = load(args)
    if isinstance(target, int):
        return target
    kwargs: dict[str, Any] = {
        **{k: v for k, v in target.extras.items() if k in ("optimizer", "loss_fn", "step_fn", "make_batch")},
        "memory": args.memory,
        "device": args.device,
        "reserve": args.reserve,
        "amp": args.amp,
        "mode": args.mode,
        "headroom": args.headroom,
        "multiple_of": args.multiple_of,
    }
    if args.max_batch is not None:
        kwargs["max_batch"] = args.max_batch
    print(
        f"batchfit {__version__}: estimating {args.target} ({args.mode}) for {args.device} with {args.memory}: "
        "fake tensors, no device and no memory used",
        file=human,
    )
    try:
        result = estimate(target.model, target.sample, **kwargs)
        table = what_if(target.model, target.sample, options=args.what_if, **kwargs) if args.what_if else None
    except NothingFitsError as exc:
        error(str(exc))
        return EXIT_DOES_NOT_FIT
    except (TypeError, ValueError) as exc:
        error(first_line(exc))
        return EXIT_USAGE
    except Exception as exc:
        report_exception(exc, args.traceback, cause=False)
        return EXIT_ERROR
    make_view(human, plain=True).summary(result)
    if args.target_batch is not None:
        print(plan_line(result, args.target_batch), file=human)
    if table is not None:
        print(table, file=human)
    if args.json:
        write_json(args.json, result.to_json())
    return EXIT_OK
