from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

# Make tests/helpers.py importable as `helpers` without installing the tests as a package.
sys.path.insert(0, str(Path(__file__).parent))

_PLUGIN = "batchfit.testing.pytest_plugin"


def _plugin_autoloaded() -> bool:
    """Whether pytest loads batchfit's plugin itself (an installed ``pytest11`` entry point)."""
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == _PLUGIN for ep in entry_points(group="pytest11"))


# From the source tree alone (a GPU box without network cannot install the project), the plugin
# that adds ``--require-cuda`` and the ``cuda`` marker is loaded from here; registering it twice
# (installed and here) is an error, so only then.
if not _plugin_autoloaded():
    pytest_plugins = [_PLUGIN]


# The default run is the fast set: tests marked `slow` (a real subprocess, a big model: more than
# a few seconds each) or `distributed` (process groups, torchrun, mp.spawn, Ray, two nodes) are
# deselected unless `--all` is given or `-m` chooses them (CI runs `-m "slow or distributed"` after
# the fast set; the GPU proof's `-m "cuda ..."` selects by its own expression, so nothing changes there).
_MARKED = ("slow", "distributed")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        default=False,
        help="batchfit: also run the tests marked 'slow' or 'distributed' (the default run skips them)",
    )


def _runs_everything(config: pytest.Config) -> bool:
    """Whether the command chose its tests itself: `--all`, a `-m` expression, or a test by its id."""
    return bool(config.getoption("--all") or config.getoption("markexpr") or any("::" in arg for arg in config.args))


#: How many tests the fast set left out, kept on the run's config for the summary line.
_DESELECTED = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _runs_everything(config):
        return
    kept = [item for item in items if not any(item.get_closest_marker(name) for name in _MARKED)]
    if len(kept) < len(items):
        kept_ids = {id(item) for item in kept}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
        config.stash[_DESELECTED] = len(items) - len(kept)
        items[:] = kept


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    deselected = config.stash.get(_DESELECTED, 0)
    if deselected:
        terminalreporter.write_line(
            f"batchfit: the fast set ran; {deselected} tests marked slow or distributed were deselected "
            '(`--all` runs everything, `-m "slow or distributed"` only those)'
        )
