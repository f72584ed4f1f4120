"""batchfit: the largest batch your model trains with, and the fastest, measured by real steps.

Public API: :func:`find`, :class:`Prober`, the result types and the errors.
"""

from batchfit.errors import BatchfitError, DeviceFailedError, NothingFitsError
from batchfit.finder import Prober, find
from batchfit.result import DeviceInfo, MemoryModel, PhaseLine, Result, Settings, Trial
from batchfit.version import __version__

__all__ = [
    "BatchfitError",
    "DeviceFailedError",
    "DeviceInfo",
    "MemoryModel",
    "NothingFitsError",
    "PhaseLine",
    "Prober",
    "Result",
    "Settings",
    "Trial",
    "__version__",
    "find",
]
