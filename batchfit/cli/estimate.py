"""``batchfit estimate TARGET --memory-limit SIZE``: the probe's answer for a memory size, on fake tensors.

With ``--world-size W``: one rank's answer for an FSDP2 job of W ranks. This process joins a fake
process group of W ranks as rank 0 *before* the target loads (as a rank of a ``--nproc-per-trial``
job joins its group first), so the target's ``fully_shard`` shards over W ranks;
`batchfit.estimation.rank_estimate` does the rest.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from batchfit.backends import DEFAULT_ESTIMATE_TARGET, default_device, estimate_target
from batchfit.cli.arguments import option_keywords
from batchfit.cli.frontier_command import check_plot_path, write_frontier
from batchfit.cli.output import (
    EXIT_DOES_NOT_FIT,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    check_json_path,
    check_plan_options,
    error,
    load,
    plan_line,
    report_exception,
    write_json,
)
from batchfit.errors import NothingFitsError, first_line
from batchfit.estimation import OPTIONS, estimate, split_memory, what_if
from batchfit.estimation.fake_ranks import fake_group
from batchfit.estimation.rank_estimate import estimate_in_group
from batchfit.probe.keywords import EstimateOptions
from batchfit.targets import TargetCallError, TargetError, load_sharded, sharded_builder
from batchfit.units import format_bytes
from batchfit.version import __version__
from batchfit.view.frontier_view import FrontierView
from batchfit.view.progress import make_view


def estimate_command(args: argparse.Namespace) -> int:
    for option in args.what_if or ():
        if option not in OPTIONS:
            raise UsageError(f"unknown --what-if {option!r}: choose from {', '.join(OPTIONS)}")
    check_plan_options(args)
    _check_length_axis(args)
    if args.world_size is not None:
        check_sharded_flags(args)
    memory = _memory_limit(args)
    device_note = ""
    if args.device is None:
        args.device = DEFAULT_ESTIMATE_TARGET
        if default_device() != DEFAULT_ESTIMATE_TARGET:  # say so: the user may expect this machine
            device_note = (
                f" (the default; this machine has no {DEFAULT_ESTIMATE_TARGET} device: "
                "--device cpu estimates for its CPU)"
            )
    try:
        device = estimate_target(args.device)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    total, kept_aside = split_memory(device, memory, args.reserve, "--memory-limit")
    if total <= kept_aside and args.reserve is None:
        raise UsageError(
            f"--memory-limit {memory} leaves nothing after the {format_bytes(kept_aside)} a CUDA GPU keeps "
            "outside the allocator: give a GPU's memory (--memory-limit 24GiB), set --reserve, or use --device cpu "
            "(see docs/concepts/measuring.md#cuda)"
        )
    if total <= kept_aside:
        raise UsageError(
            f"--memory-limit {memory} leaves nothing after --reserve {args.reserve}: give a smaller --reserve"
        )
    check_json_path(args.json)
    human = sys.stderr if args.json == "-" else sys.stdout
    if args.world_size is not None:
        print(
            f"batchfit {__version__}: estimating {args.target} ({args.mode}) sharded over {args.world_size} rank(s), "
            f"per rank for {args.device}{device_note} with {memory}: rank 0 in a fake process group, fake tensors",
            file=human,
        )
        keywords = {
            **option_keywords(args, EstimateOptions),
            "memory_limit": memory,
            "device": args.device,
            "reserve": args.reserve,
        }
        return estimate_sharded_command(args, keywords, human, _estimated)
    target = load(args)
    if isinstance(target, int):
        return target
    kwargs: dict[str, Any] = {
        **target.extras,  # optimizer, loss_fn, step_fn, make_batch, criterion: the same keys as the probe's
        **option_keywords(args, EstimateOptions),
        "memory_limit": memory,
        "device": args.device,
        "reserve": args.reserve,
    }
    print(
        f"batchfit {__version__}: estimating {args.target} ({args.mode}) for {args.device}{device_note} with {memory}: "
        "fake tensors, no device and no memory used",
        file=human,
    )
    unused = target.unused_note("estimate")
    if unused is not None:
        print(f"  {unused}", file=human)
    if args.seq_lens is not None:
        return _estimate_frontier(args, target, kwargs, human)

    def both() -> tuple[Any, Any]:
        result = estimate(target.model, target.sample, **kwargs)
        table = what_if(target.model, target.sample, options=args.what_if, **kwargs) if args.what_if else None
        return result, table

    answer, failed = _estimated(both, args.traceback)
    if failed is not None:
        return failed
    result, table = answer
    make_view(human, plain=True).summary(result)
    if args.target_batch is not None or args.target_tokens is not None:
        print(plan_line(result, args.target_batch, target_tokens=args.target_tokens, seq_len=args.seq_len), file=human)
    if table is not None:
        print(table, file=human)
    if args.json:
        write_json(args.json, result.to_json())
    return EXIT_OK


def _check_length_axis(args: argparse.Namespace) -> None:
    """``--seq-lens`` asks for a frontier: refuse, before the target loads, what goes with one length only."""
    if args.seq_lens is None:
        alone = [
            name
            for name, given in (
                ("--max-seq-len", args.max_seq_len is not None),
                ("--no-longest", args.no_longest),
                ("--plot", args.plot is not None),
            )
            if given
        ]
        if alone:
            raise UsageError(f"{', '.join(alone)} go with --seq-lens (an estimated frontier)")
        return
    one_length = [
        name
        for name, given in (
            ("--seq-len", args.seq_len is not None),
            ("--what-if", bool(args.what_if)),
            ("--target-batch", args.target_batch is not None),
            ("--target-tokens", args.target_tokens is not None),
        )
        if given
    ]
    if one_length:
        raise UsageError(f"{', '.join(one_length)} go with one length, not with --seq-lens")
    if args.max_seq_len is not None and args.no_longest:
        raise UsageError("--max-seq-len bounds the search for the longest length at batch 1: drop --no-longest")
    check_plot_path(args.plot)


def _estimate_frontier(args: argparse.Namespace, target: Any, kwargs: dict[str, Any], human: Any) -> int:
    """``--seq-lens``: [`batchfit.estimate`][batchfit.estimate]'s frontier, shown and written as ``batchfit
    frontier``'s."""
    if kwargs.get("make_batch") is None:  # a sample beside make_batch was left out when it loaded
        raise UsageError(
            f"--seq-lens needs {args.target} to give 'make_batch', a function (batch_size, seq_len) -> batch"
        )
    kwargs.update(seq_lens=list(args.seq_lens), longest_at_batch_1=not args.no_longest)
    if args.max_seq_len is not None:
        kwargs["max_seq_len"] = args.max_seq_len
    frontier, failed = _estimated(lambda: estimate(target.model, **kwargs), args.traceback)
    if failed is not None:
        return failed
    FrontierView(human, plain=True).summary(frontier)
    write_frontier(frontier, args.json, args.plot, human)
    return EXIT_OK


def _estimated(call: Callable[[], Any], traceback: bool) -> tuple[Any, int | None]:
    """``call()``'s answer, or the exit code of its failure, said on stderr: not even the smallest
    batch fits (3), bad arguments (2), anything else (1)."""
    try:
        return call(), None
    except NothingFitsError as exc:
        error(str(exc))
        return None, EXIT_DOES_NOT_FIT
    except (TypeError, ValueError) as exc:
        error(first_line(exc))
        return None, EXIT_USAGE
    except Exception as exc:
        report_exception(exc, traceback, cause=False)
        return None, EXIT_ERROR


def check_sharded_flags(args: argparse.Namespace) -> None:
    """What ``--world-size`` does not go with, refused before the target loads."""
    alone = [name for name, given in (("--seq-lens", args.seq_lens is not None), ("--what-if", args.what_if)) if given]
    if alone:
        raise UsageError(f"--world-size (a sharded estimate) does not go with {', '.join(alone)} yet")


def estimate_sharded_command(
    args: argparse.Namespace, keywords: dict[str, Any], human: Any, estimated: Callable[..., tuple[Any, int | None]]
) -> int:
    """The sharded estimate, in this process, shown and written as ``batchfit estimate``'s (keywords:
    the flags' own; ``estimated``: its way of turning a failure into an exit code)."""
    with fake_group(args.world_size):
        try:
            target = load_sharded(args.target, args.world_size)
        except (TargetError, ValueError) as exc:
            error(str(exc))
            return EXIT_USAGE
        except TargetCallError as exc:
            report_exception(exc, args.traceback, cause=True)
            return EXIT_ERROR
        kwargs = {**target.extras, **keywords}
        build = sharded_builder(args.target, args.world_size)
        del target
        result, failed = estimated(
            lambda: estimate_in_group(build, args.world_size, where=args.target, **kwargs), args.traceback
        )
    if failed is not None:
        return failed
    make_view(human, plain=True).summary(result)
    if args.target_batch is not None or args.target_tokens is not None:
        print(plan_line(result, args.target_batch, target_tokens=args.target_tokens, seq_len=args.seq_len), file=human)
    if args.json:
        write_json(args.json, result.to_json())
    return EXIT_OK


def _memory_limit(args: argparse.Namespace) -> str:
    """``--memory-limit``, the probe's name for the same thing; ``--memory`` (0.1.0's spelling)
    still works, with a warning on stderr."""
    if args.memory is not None and args.memory_limit is not None:
        raise UsageError("give --memory-limit only: --memory is its old name")
    if args.memory is not None:
        print("batchfit: warning: --memory is deprecated: use --memory-limit (the probe's name)", file=sys.stderr)
        return str(args.memory)
    if args.memory_limit is None:
        raise UsageError("--memory-limit is required: the memory of the device to estimate for, e.g. 24GiB")
    return str(args.memory_limit)
