"""batchfit in tests and CI: the gate ("does batch N still fit within X?") and the pytest plugin.

* [`batchfit.testing.gate`][batchfit.testing.gate]: [`check_fits`][batchfit.testing.gate.check_fits],
  [`assert_fits`][batchfit.testing.gate.assert_fits], [`GateReport`][batchfit.testing.gate.GateReport]
  (``batchfit probe --require-batch N`` runs the same [`check_fits`][batchfit.testing.gate.check_fits]);
* [`batchfit.testing.pytest_plugin`][batchfit.testing.pytest_plugin]: the ``cuda`` marker and
  ``--require-cuda`` (entry point ``pytest11: batchfit``).

Names are imported on first use: pytest loads the plugin at start-up in every suite where batchfit
is installed, and that must not import torch (``batchfit._lazy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_surface

if TYPE_CHECKING:
    from batchfit.testing.gate import GateReport, assert_fits, check_fits

_EXPORTS = {
    "GateReport": "batchfit.testing.gate",
    "assert_fits": "batchfit.testing.gate",
    "check_fits": "batchfit.testing.gate",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_surface(__name__, globals(), _EXPORTS)
