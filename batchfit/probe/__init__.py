"""The probe: real training steps at a batch size, on one device, leaving the user's objects as
they were, and the algorithm that turns trials into an answer.

* `options`: every knob, validated once ([`Options`][batchfit.Options]);
* `batches` and `workload`: what a batch is and what one
  step runs (the model, the loss, the optimizer, autocast); `compiled`: a
  ``torch.compile``'d model;
* `trial`: one trial (batch, steps, timing, memory, clean-up);
* `state`: the snapshot and exact restore of model, optimizer, RNG;
* `checks`: the input checks every entry point shares, the model's facts;
* `real_data`: the batch that drives memory, picked from a loader's real data
  (`worst_batch`); `positions`: the model's position limit
  (`position_limit`);
* `runner`: the seam every way of running trials implements (`Runner`: open, run, settle, close);
  `prober`: [`Prober`][batchfit.Prober], the lifetime of a probe on this device, one `Runner`;
* `finder`: `search_with` (over any `Runner`) and `find_with`, the algorithm, with
  `safe_batch` and `notes`;
* `lengths`: `frontier_with`, the largest batch per sequence length
  (one probe per length, each further one searched from the surface's prediction);
* `checkpointing_blocks` and `checkpointing_search`: activation checkpointing of k of a model's
  repeated blocks, applied and undone exactly, and `fit_with`, the policy that trains a target
  batch fastest;
* `job_runner`: a `Runner` whose trials are fresh ``torchrun`` jobs (sharded models), each rank a
  `batchfit.worker` process (`job_worker`, its request through `wire`); `job_search`: the search
  over them, from ``init_batch`` or from a guess;
* `noise_measure`: `measure_noise`, the gradient noise scale of real batches;
* `cache`: the result cache (``find(cache=DIR)``: `ResultCache`), keyed
  by `keys` (`probe_key`, `cache_key`), its entries on disk in
  `cache_files` (no torch).

The keyword front end users call, [`batchfit.find`][batchfit.find], is `batchfit.api`'s.

Names are imported on first use: [`Options`][batchfit.Options] is pure Python, and the CLI and
``batchfit.plan`` read it before (or without) importing torch (``batchfit._lazy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_surface

if TYPE_CHECKING:
    from batchfit.probe.checkpointing_search import fit_with
    from batchfit.probe.finder import find_with
    from batchfit.probe.lengths import PointCallback, check_lengths, frontier_with
    from batchfit.probe.noise_measure import measure_noise
    from batchfit.probe.options import DEFAULT_MAX_BATCH, Options
    from batchfit.probe.positions import position_limit
    from batchfit.probe.prober import Prober
    from batchfit.probe.real_data import is_batch_source

_EXPORTS = {
    "find_with": "batchfit.probe.finder",
    "fit_with": "batchfit.probe.checkpointing_search",
    "PointCallback": "batchfit.probe.lengths",
    "check_lengths": "batchfit.probe.lengths",
    "frontier_with": "batchfit.probe.lengths",
    "measure_noise": "batchfit.probe.noise_measure",
    "DEFAULT_MAX_BATCH": "batchfit.probe.options",
    "Options": "batchfit.probe.options",
    "position_limit": "batchfit.probe.positions",
    "Prober": "batchfit.probe.prober",
    "is_batch_source": "batchfit.probe.real_data",
}
#: Names this surface exported before issue 33 that are internals: they still import, with a warning.
_MOVED = {"own_loss": "batchfit.probe.workload", "worst_batch": "batchfit.probe.real_data"}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_surface(__name__, globals(), _EXPORTS, _MOVED)
