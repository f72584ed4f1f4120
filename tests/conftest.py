import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

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
