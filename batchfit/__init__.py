"""batchfit: the largest batch your model trains with, and the fastest, measured by real steps.

Public API: :func:`find`, :class:`Prober`, :class:`Options`, the result types and the errors.

Names are imported lazily (PEP 562): batchfit is also a pytest plugin and a CLI, and neither
``pytest`` start-up nor ``batchfit devices`` / ``--help`` should pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchfit.version import __version__

if TYPE_CHECKING:
    from batchfit.errors import BatchfitError, DeviceFailedError, LimitError, NoOptimizerStepError, NothingFitsError
    from batchfit.estimation import estimate
    from batchfit.finder import Prober, find
    from batchfit.options import Options
    from batchfit.planning import Plan, plan
    from batchfit.result import DeviceInfo, MemoryModel, PhaseLine, Result, Settings, Throughput, Trial
    from batchfit.whatif import WhatIf, what_if

_EXPORTS = {
    "BatchfitError": "batchfit.errors",
    "DeviceFailedError": "batchfit.errors",
    "NothingFitsError": "batchfit.errors",
    "LimitError": "batchfit.errors",
    "NoOptimizerStepError": "batchfit.errors",
    "Options": "batchfit.options",
    "Prober": "batchfit.finder",
    "find": "batchfit.finder",
    "estimate": "batchfit.estimation",
    "Plan": "batchfit.planning",
    "plan": "batchfit.planning",
    "WhatIf": "batchfit.whatif",
    "what_if": "batchfit.whatif",
    "DeviceInfo": "batchfit.result",
    "MemoryModel": "batchfit.result",
    "PhaseLine": "batchfit.result",
    "Result": "batchfit.result",
    "Settings": "batchfit.result",
    "Throughput": "batchfit.result",
    "Trial": "batchfit.result",
}

__all__ = [
    "BatchfitError",
    "DeviceFailedError",
    "DeviceInfo",
    "LimitError",
    "MemoryModel",
    "NoOptimizerStepError",
    "NothingFitsError",
    "Options",
    "PhaseLine",
    "Plan",
    "Prober",
    "Result",
    "Settings",
    "Throughput",
    "Trial",
    "WhatIf",
    "__version__",
    "estimate",
    "find",
    "plan",
    "what_if",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'batchfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
