"""``batchfit frontier TARGET --seq-lens 128,256,512``: the largest batch at each sequence length.

The target gives a model and ``make_batch(batch_size, seq_len)`` (a mapping with ``model`` and
``make_batch``; a ``sample`` is not needed). The command runs [`batchfit.frontier`][batchfit.frontier] with the
probe's options, shows a row per finished length (``batchfit.view``), then the frontier's table and
its chart; ``--json`` writes the frontier's document, ``--plot`` an image of it (the ``plot`` extra).

Exit codes as the probe's (``batchfit.cli``): 0 ok, 1 error, 2 usage or bad target (a target
without ``make_batch``, a length the model cannot take, a ``--json`` or ``--plot`` path that cannot
be written, ``--plot`` without matplotlib: all before the first trial), 3 not even batch 1 fits,
130 Ctrl-C, 141 stdout closed, 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from typing import Any

import batchfit.api as api  # frontier through its module: a patch of it there is seen
from batchfit.backends import default_device
from batchfit.cli.arguments import limit_lines, option_keywords
from batchfit.cli.output import EXIT_OK, UsageError, check_json_path, load, write_json
from batchfit.cli.probe import Calls, probe_failed, run_shown
from batchfit.probe.keywords import FrontierOptions
from batchfit.report.frontier_plot import require_matplotlib, save_frontier_plot
from batchfit.targets import Target
from batchfit.version import __version__
from batchfit.view.frontier_view import FrontierView

#: The image formats ``--plot`` writes (matplotlib's own, without Pillow).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def frontier_command(args: argparse.Namespace) -> int:
    if args.max_seq_len is not None and args.no_longest:
        raise UsageError("--max-seq-len bounds the search for the longest length at batch 1: drop --no-longest")
    check_json_path(args.json)
    check_plot_path(args.plot)
    device, limit, header = frontier_plan(args)
    loaded = load(args)
    if isinstance(loaded, int):
        return loaded
    make_batch, kwargs = frontier_kwargs(args, loaded, device, limit)
    human = sys.stderr if args.json == "-" else sys.stdout
    view = FrontierView(human, quiet=args.quiet)
    calls = Calls(view)  # type: ignore[arg-type]  # the view takes a probe's callbacks too

    def run() -> Any:
        view.start(header, args.seq_lens)
        return api.frontier(loaded.model, make_batch, on_point=view.point_finished, **calls.kwargs(), **kwargs)

    result, failure = run_shown(view, run)
    if failure is not None:
        return probe_failed(failure, calls, args.traceback)
    view.summary(result)
    write_frontier(result, args.json, args.plot, None if args.quiet else human)
    return EXIT_OK


def frontier_plan(args: argparse.Namespace) -> tuple[str, str | None, list[str]]:
    """The device, the memory limit and the header lines (as a probe's: ``batchfit.cli.arguments``)."""
    device = args.device or default_device()
    lengths = ", ".join(f"{s:,}" for s in args.seq_lens)
    longest = "" if args.no_longest else " and the longest length at batch 1"
    header = [
        f"batchfit {__version__}: frontier of {args.target} ({args.mode}) on {device}: seq_len {lengths}{longest}"
    ]
    limit, lines, _ = limit_lines(device, args.memory_limit, bool(args.device), args.reserve)
    return device, limit, header + lines


def frontier_kwargs(
    args: argparse.Namespace, target: Target, device: str, limit: str | None
) -> tuple[Any, dict[str, Any]]:
    """The target's ``make_batch`` (checked: it takes ``(batch_size, seq_len)``) and
    [`batchfit.frontier`][batchfit.frontier]'s keywords: the target's extras and the command line's options."""
    make_batch = lengths_batches(target, "batchfit frontier")
    if make_batch is None:
        raise UsageError(
            f"{target.spec} gave no make_batch: batchfit frontier builds every batch with "
            "make_batch(batch_size, seq_len); return a mapping with 'model' and 'make_batch'"
        )
    kwargs: dict[str, Any] = {
        **{key: value for key, value in target.extras.items() if key != "make_batch"},
        **option_keywords(args, FrontierOptions),
        "seq_lens": args.seq_lens,
        "longest_at_batch_1": not args.no_longest,
        "device": device,
        "memory_limit": limit,
    }
    if args.max_seq_len is not None:
        kwargs["max_seq_len"] = args.max_seq_len
    return make_batch, kwargs


def lengths_batches(target: Target, command: str) -> Any:
    """The target's ``make_batch`` (``None`` when it gave none), checked to take ``(batch_size,
    seq_len)`` as ``command`` calls it: a `UsageError` otherwise, before anything runs."""
    make_batch = target.extras.get("make_batch")
    if make_batch is None:
        return None
    try:
        inspect.signature(make_batch).bind(1, 1)
    except TypeError:
        raise UsageError(
            f"{target.spec}'s make_batch must take (batch_size, seq_len): {command} calls it with both"
        ) from None
    except ValueError:  # no signature to read (a builtin): the call will tell
        pass
    return make_batch


def check_plot_path(path: str | None) -> None:
    """Refuse (exit 2) a ``--plot PATH`` before anything runs: matplotlib missing (the ``plot``
    extra), or a path that cannot be written (as ``--json``'s)."""
    if path is None:
        return
    try:
        require_matplotlib()
    except ImportError as exc:
        raise UsageError(f"--plot: {exc}") from None
    if path == "-":
        raise UsageError("--plot needs a file name, such as frontier.png (an image does not go to stdout)")
    try:
        check_json_path(path)
    except UsageError as exc:
        raise UsageError(str(exc).replace("--json", "--plot", 1)) from None
    if os.path.splitext(path)[1].lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot {path!r}: name an image file ({', '.join(PLOT_SUFFIXES)})")


def write_frontier(frontier: Any, json_path: str | None, plot_path: str | None, said_to: Any) -> None:
    """``--json`` and ``--plot`` of a frontier (measured or estimated); ``said_to``: where to say
    the plot was written (``None``: quietly)."""
    if json_path:
        write_json(json_path, frontier.to_json())
    if plot_path:
        write_plot(frontier, plot_path)
        if said_to is not None:
            print(f"plot written to {plot_path}", file=said_to)


def write_plot(frontier: Any, path: str) -> None:
    """Draw ``--plot``; a write that fails after the run is exit 2, the frontier's text already shown."""
    try:
        save_frontier_plot(frontier, path)
    except OSError as exc:
        raise UsageError(f"cannot write --plot {path!r}: {exc.strerror or exc}") from None
