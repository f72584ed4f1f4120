"""Answers without the device: the estimate on fake tensors, the plan for a global batch, what-if.

* :mod:`~batchfit.estimation.fake_trials`: the probe's steps on fake tensors (:class:`FakeProbe`);
* :mod:`~batchfit.estimation.estimator`: :func:`estimate`, the probe's search over fake trials;
* :mod:`~batchfit.estimation.planning`: :func:`plan_for`, a global batch as micro-batch x
  accumulation x ranks (pure Python: a plan can be made from a result read from JSON);
* :mod:`~batchfit.estimation.whatif`: :func:`what_if`, the estimate under each lever in one table.

Names are imported on first use, so that planning from a result needs no torch
(``batchfit._lazy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_surface

if TYPE_CHECKING:
    from batchfit.estimation.estimator import FALLBACK_CAP, TARGETS, estimate, split_memory
    from batchfit.estimation.fake_trials import FakeProbe, Untraceable
    from batchfit.estimation.planning import ALTERNATIVE_FACTOR, Plan, check_target, plan_for, tokens_to_batch
    from batchfit.estimation.whatif import (
        DEFAULT_OPTIONS,
        OPTIONS,
        WhatIf,
        WhatIfRow,
        checkpointing,
        parse_option,
        what_if,
    )

_EXPORTS = {
    "FALLBACK_CAP": "batchfit.estimation.estimator",
    "TARGETS": "batchfit.estimation.estimator",
    "estimate": "batchfit.estimation.estimator",
    "split_memory": "batchfit.estimation.estimator",
    "FakeProbe": "batchfit.estimation.fake_trials",
    "Untraceable": "batchfit.estimation.fake_trials",
    "ALTERNATIVE_FACTOR": "batchfit.estimation.planning",
    "Plan": "batchfit.estimation.planning",
    "plan_for": "batchfit.estimation.planning",
    "check_target": "batchfit.estimation.planning",
    "tokens_to_batch": "batchfit.estimation.planning",
    "DEFAULT_OPTIONS": "batchfit.estimation.whatif",
    "OPTIONS": "batchfit.estimation.whatif",
    "WhatIf": "batchfit.estimation.whatif",
    "WhatIfRow": "batchfit.estimation.whatif",
    "checkpointing": "batchfit.estimation.whatif",
    "parse_option": "batchfit.estimation.whatif",
    "what_if": "batchfit.estimation.whatif",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_surface(__name__, globals(), _EXPORTS)
