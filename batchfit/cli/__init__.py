"""The ``batchfit`` command line: ``probe``, ``estimate`` and ``devices`` (entry point :func:`main`).

* :mod:`batchfit.cli.main`: the entry point, the exit codes a CI pipeline reads;
* :mod:`batchfit.cli.parser`: every command's arguments; :mod:`batchfit.cli.values`: the types that check each value;
* :mod:`batchfit.cli.probe`, :mod:`~batchfit.cli.estimate`, :mod:`~batchfit.cli.devices`: one
  subcommand each; :mod:`batchfit.cli.jobs`: ``--nproc-per-trial``'s two sides;
* :mod:`batchfit.cli.targets`: loading ``package.module:factory`` targets;
* :mod:`batchfit.cli.output` and :mod:`batchfit.cli.signals`: error lines, ``--json`` files, SIGTERM.

``batchfit --help`` and ``batchfit devices`` never import torch: every subcommand imports what it
runs inside its function.
"""

from batchfit.cli.main import main

__all__ = ["main"]
