"""batchfit: the largest batch your model trains with, and the fastest, measured by real steps.

Public API: [`find`][batchfit.find], [`fit`][batchfit.fit], [`frontier`][batchfit.frontier],
[`find_sharded`][batchfit.find_sharded], [`estimate`][batchfit.estimate],
[`estimate_sharded`][batchfit.estimate_sharded], [`plan`][batchfit.plan],
[`what_if`][batchfit.what_if], [`buckets`][batchfit.buckets], [`soak`][batchfit.soak],
[`schedule`][batchfit.schedule], [`Prober`][batchfit.Prober],
[`Options`][batchfit.Options], the result types and the errors. Integrations: ``batchfit.lightning``,
``batchfit.transformers``, ``batchfit.accelerate``; the CI gate: ``batchfit.testing``.

Names are imported lazily (PEP 562, ``batchfit._lazy``): batchfit is also a pytest plugin and a
CLI, and neither ``pytest`` start-up nor ``batchfit devices`` / ``--help`` should pay for
importing torch. Where each name lives, and the layers of the package, are in CONTRIBUTING.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_surface
from batchfit.version import __version__

if TYPE_CHECKING:
    from batchfit.api import find, fit, frontier, noise_scale, plan
    from batchfit.api_jobs import find_sharded
    from batchfit.api_schedule import schedule
    from batchfit.api_varlen import buckets, soak
    from batchfit.errors import BatchfitError, DeviceFailedError, LimitError, NoOptimizerStepError, NothingFitsError
    from batchfit.estimation import Plan, WhatIf, estimate, estimate_sharded, what_if
    from batchfit.probe import Options, Prober
    from batchfit.report import (
        DeviceInfo,
        Evaluation,
        Fit,
        Frontier,
        FrontierPoint,
        Generation,
        LengthPlan,
        MemoryModel,
        PhaseLine,
        Recommendation,
        Result,
        Settings,
        Surface,
        Throughput,
        Trial,
        recommend,
    )

_EXPORTS = {
    "BatchfitError": "batchfit.errors",
    "DeviceFailedError": "batchfit.errors",
    "NothingFitsError": "batchfit.errors",
    "LimitError": "batchfit.errors",
    "NoOptimizerStepError": "batchfit.errors",
    "Options": "batchfit.probe",
    "Prober": "batchfit.probe",
    "find": "batchfit.api",
    "find_sharded": "batchfit.api_jobs",
    "fit": "batchfit.api",
    "plan": "batchfit.api",
    "frontier": "batchfit.api",
    "noise_scale": "batchfit.api",
    "buckets": "batchfit.api_varlen",
    "soak": "batchfit.api_varlen",
    "schedule": "batchfit.api_schedule",
    "LengthPlan": "batchfit.report",
    "Fit": "batchfit.report",
    "Frontier": "batchfit.report",
    "FrontierPoint": "batchfit.report",
    "Surface": "batchfit.report",
    "estimate": "batchfit.estimation",
    "estimate_sharded": "batchfit.estimation",
    "Plan": "batchfit.estimation",
    "WhatIf": "batchfit.estimation",
    "what_if": "batchfit.estimation",
    "DeviceInfo": "batchfit.report",
    "Evaluation": "batchfit.report",
    "Generation": "batchfit.report",
    "MemoryModel": "batchfit.report",
    "PhaseLine": "batchfit.report",
    "Recommendation": "batchfit.report",
    "recommend": "batchfit.report",
    "Result": "batchfit.report",
    "Settings": "batchfit.report",
    "Throughput": "batchfit.report",
    "Trial": "batchfit.report",
}

__all__ = sorted([*_EXPORTS, "__version__"])

__getattr__, __dir__ = lazy_surface(__name__, globals(), _EXPORTS)
