"""The ``batchfit`` command line: ``probe``, ``estimate``, ``frontier``, ``fit`` and ``devices`` (entry point `main`).

* `batchfit.cli.main`: the entry point, the exit codes a CI pipeline reads;
* `batchfit.cli.parser`: every command's arguments; `batchfit.cli.values`: the types that check each value;
* `batchfit.cli.probe`, `estimate`, `frontier_command`, `fit`, `devices`: one subcommand each;
* `batchfit.targets`: loading ``package.module:factory`` targets;
* `batchfit.cli.output` and `batchfit.cli.signals`: error lines, ``--json`` files, SIGTERM.

The command line is for users only: it calls the library, and the library's own processes (a job's
ranks, the sharded estimate's) run `batchfit.worker`, not a command. ``batchfit --help`` and
``batchfit devices`` never import torch: `main` imports each other command's module when it runs.
"""

from batchfit.cli.main import main

__all__ = ["main"]
