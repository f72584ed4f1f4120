"""The ``batchfit`` command line: ``probe``, ``estimate`` and ``devices`` (entry point `main`).

* `batchfit.cli.main`: the entry point, the exit codes a CI pipeline reads;
* `batchfit.cli.parser`: every command's arguments; `batchfit.cli.values`: the types that check each value;
* `batchfit.cli.probe`, `estimate`, `devices`: one
  subcommand each; `batchfit.cli.probe_jobs`: ``--nproc-per-trial``'s two sides;
* `batchfit.targets`: loading ``package.module:factory`` targets;
* `batchfit.cli.output` and `batchfit.cli.signals`: error lines, ``--json`` files, SIGTERM.

``batchfit --help`` and ``batchfit devices`` never import torch: every subcommand imports what it
runs inside its function.
"""

from batchfit.cli.main import main

__all__ = ["main"]
