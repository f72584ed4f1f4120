"""Answers without the device: the estimate on fake tensors, the plan for a global batch, what-if.

* `fake_trials`: the probe's steps on fake tensors (`FakeProbe`);
* `estimator`: [`estimate`][batchfit.estimate], the probe's search over fake trials;
* `sharded`: [`estimate_sharded`][batchfit.estimate_sharded], one rank of an FSDP2 job, in a fake process group;
* `planning`: [`plan_for`][batchfit.estimation.planning.plan_for], a global batch as micro-batch x
  accumulation x ranks (pure Python: a plan can be made from a result read from JSON);
* `whatif`: [`what_if`][batchfit.what_if], the estimate under each lever in one table.

Names are imported on first use, so that planning from a result needs no torch
(``batchfit._lazy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_surface

if TYPE_CHECKING:
    from batchfit.estimation.estimate_setup import split_memory
    from batchfit.estimation.estimator import estimate
    from batchfit.estimation.planning import Plan, check_target, plan_for
    from batchfit.estimation.rank_estimate import estimate_sharded
    from batchfit.estimation.whatif import OPTIONS, WhatIf, what_if

_EXPORTS = {
    "estimate": "batchfit.estimation.estimator",
    "split_memory": "batchfit.estimation.estimate_setup",
    "estimate_sharded": "batchfit.estimation.rank_estimate",
    "Plan": "batchfit.estimation.planning",
    "check_target": "batchfit.estimation.planning",
    "plan_for": "batchfit.estimation.planning",
    "OPTIONS": "batchfit.estimation.whatif",
    "WhatIf": "batchfit.estimation.whatif",
    "what_if": "batchfit.estimation.whatif",
}
#: Names this surface exported before issue 33 that are internals: they still import, with a warning.
_MOVED = {"tokens_to_batch": "batchfit.estimation.planning"}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_surface(__name__, globals(), _EXPORTS, _MOVED)
