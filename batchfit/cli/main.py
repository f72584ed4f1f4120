"""The ``batchfit`` command: ``batchfit probe TARGET`` (with ``--buckets LENGTHS``: variable-length
data, ``batchfit.cli.buckets_command``), ``batchfit estimate TARGET``, ``batchfit frontier TARGET
--seq-lens ...``, ``batchfit fit TARGET --target-batch N`` and ``batchfit devices``.

Exit codes are the interface a CI pipeline reads, so they are fixed and documented:

* 0: the probe finished (with ``--require-batch N``: batch N fits).
* 1: an error, including an exception raised by the user's factory or model.
* 2: a usage error: bad option, or a bad target (no such module or attribute, a factory that
  needs arguments, a value that is not ``(model, sample)``, a sample without tensors, a model
  or sample that ``find()`` rejects before its first trial), or a ``--json`` path that cannot be
  written. (A write that fails only after the probe, on a full disk, saves the JSON to a
  temporary file and names it in the error: the result is not lost.)
* 3: does not fit: with ``--require-batch N``, batch N ran out of memory within the limit;
  without it, not even the smallest batch fitted (``fit --no-accumulate``: no checkpointing
  policy fits the target batch in one step).
* 130: interrupted by Ctrl-C, with one line and no traceback, from start-up on. Once the probe had
  started, the model and optimizer were restored (the message says so); while batchfit was
  starting or the target was still loading there was nothing to restore.
* 141: the reader of stdout went away (``batchfit probe ... | head -1``): the probe stops at its
  next line of output, quietly, with the code a shell gives a tool killed by SIGPIPE (128 + 13),
  so ``set -o pipefail`` sees that the probe did not finish; no JSON file is written.
* 143: terminated by SIGTERM during a probe (128 + 15). It unwinds as Ctrl-C does: the live
  view is taken down (a terminal gets its cursor back) and the model is restored. A second
  SIGTERM stops a probe stuck in the user's code at once (see `_SigtermUnwinds`).
  Outside a probe (the target loading) SIGTERM keeps its default action.

A target that calls ``sys.exit(n)`` (at import, in its factory, in the model) does not end
batchfit with its code: that is an error in the target, reported as such, exit 1.

Under ``torchrun`` every rank runs this command and exits with these codes; only rank 0 prints
the view and writes ``--json`` (``batchfit.distributed.launch``), and another rank's failure is told by rank 0
and by the rank that failed.

Human output goes to stdout (to stderr when ``--json -`` puts the JSON on stdout), within
``COLUMNS`` when that is set, piped or not (``batchfit.view``). Every error
goes to stderr in a line starting with ``batchfit: error:``: batchfit's own are that one line;
a command line that argparse rejects prints the usage first (argparse's ``batchfit probe:
error:`` prefix is replaced by the same ``batchfit: error:``). ``--json PATH`` is checked before
the target is loaded, so a path that cannot be written fails at once, not after the probe.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from batchfit.cli.devices import devices_command
from batchfit.cli.lengths_arguments import uses_lengths
from batchfit.cli.output import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    UsageError,
    error,
    stdout_to_devnull,
)
from batchfit.cli.parser import build_parser
from batchfit.cli.signals import Terminated


def run_command(args: argparse.Namespace) -> int:
    """Run the subcommand the parser named. Each command module is imported here, when it runs:
    ``batchfit --help`` and ``batchfit devices`` never import torch, which the others load."""
    if args.command == "devices":
        return devices_command(args)
    if args.command == "probe" and uses_lengths(args):
        from batchfit.cli.buckets_command import buckets_command  # lazy: torch, for this command only

        return buckets_command(args)
    if args.command == "probe":
        from batchfit.cli.probe import probe_command  # lazy: torch, for this command only

        return probe_command(args)
    if args.command == "estimate":
        from batchfit.cli.estimate import estimate_command  # lazy: torch, for this command only

        return estimate_command(args)
    if args.command == "frontier":
        from batchfit.cli.frontier_command import frontier_command  # lazy: torch, for this command only

        return frontier_command(args)
    from batchfit.cli.fit import fit_command  # lazy: torch, for this command only

    return fit_command(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script and of ``python -m batchfit``; returns the exit code."""
    # torch warns "Failed to initialize NumPy" at import when NumPy is missing (it is optional):
    # the first thing a new user sees must be batchfit's own output.
    warnings.filterwarnings("ignore", message=r".*Failed to initialize NumPy", category=UserWarning)
    try:
        args = build_parser().parse_args(argv)  # exits 2 on a usage error, as argparse does
        args.argv = list(sys.argv[1:] if argv is None else argv)  # a child may run the same command again
        return int(run_command(args))
    except UsageError as exc:
        error(str(exc))
        return EXIT_USAGE
    except Terminated:
        error("terminated by SIGTERM")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        # Not from inside a probe (probe_command answers those): batchfit was starting or the
        # target was loading (importing torch, building the model), so nothing to restore.
        error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Our stdout's reader went away (a BrokenPipeError from the user's model is reported as an
        # error inside probe_command). Python's documented way out: point stdout at devnull, so the flush
        # at exit does not raise again, and leave without a word.
        stdout_to_devnull()
        return EXIT_BROKEN_PIPE
