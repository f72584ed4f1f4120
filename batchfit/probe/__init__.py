"""The probe: real training steps at a batch size, on one device, leaving the user's objects as
they were, and the algorithm that turns trials into an answer.

* :mod:`~batchfit.probe.options`: every knob, validated once (:class:`Options`);
* :mod:`~batchfit.probe.batches` and :mod:`~batchfit.probe.workload`: what a batch is and what one
  step runs (the model, the loss, the optimizer, autocast); :mod:`~batchfit.probe.compiled`: a
  ``torch.compile``'d model;
* :mod:`~batchfit.probe.trial`: one trial (batch, steps, timing, memory, clean-up);
* :mod:`~batchfit.probe.state`: the snapshot and exact restore of model, optimizer, RNG;
* :mod:`~batchfit.probe.checks`: the input checks every entry point shares, the model's facts;
* :mod:`~batchfit.probe.real_data`: the batch that drives memory, picked from a loader's real data
  (:func:`worst_batch`); :mod:`~batchfit.probe.positions`: the model's position limit
  (:func:`position_limit`);
* :mod:`~batchfit.probe.prober`: :class:`Prober`, the lifetime of a probe;
* :mod:`~batchfit.probe.finder`: :func:`search_with` and :func:`find_with`, the algorithm, with
  :mod:`~batchfit.probe.safe_batch` and :mod:`~batchfit.probe.notes`;
* :mod:`~batchfit.probe.frontier`: :func:`frontier_with`, the largest batch per sequence length
  (one probe per length, each further one searched from the surface's prediction);
* :mod:`~batchfit.probe.jobs`: a prober whose trials are fresh ``torchrun`` jobs (sharded models);
* :mod:`~batchfit.probe.noise`: :func:`measure_noise`, the gradient noise scale of real batches;
* :mod:`~batchfit.probe.cache`: the result cache (``find(cache=DIR)``: :class:`ResultCache`), keyed
  by :mod:`~batchfit.probe.keys` (:func:`probe_key`, :func:`cache_key`), its entries on disk in
  :mod:`~batchfit.probe.cache_files` (no torch).

The keyword front end users call, :func:`batchfit.find`, is :mod:`batchfit.api`'s.

Names are imported on first use: :class:`Options` is pure Python, and the CLI and
``batchfit.plan`` read it before (or without) importing torch (``batchfit._lazy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_surface

if TYPE_CHECKING:
    from batchfit.probe.batches import batch_size_of, map_tensors, tensor_leaves, tile, to_device
    from batchfit.probe.cache import ResultCache, open_cache
    from batchfit.probe.cache_files import CACHE_SCHEMA, canonical_json, check_entry, entry_document, write_atomically
    from batchfit.probe.checks import (
        check_callbacks,
        check_materialised,
        check_work,
        fit_memory,
        fixed_memory_advice,
        loss_notes,
        parameter_bytes,
    )
    from batchfit.probe.compiled import Compiled, compile_notes, compile_seconds, compiled_info, mark_batch_dynamic
    from batchfit.probe.finder import (
        ProbeStartCallback,
        StartCallback,
        TrialCallback,
        find_with,
        search_with,
        settings_of,
        verdict,
    )
    from batchfit.probe.frontier import LENGTH_CEILING, PointCallback, ProberFactory, check_lengths, frontier_with
    from batchfit.probe.jobs import JobPerTrial, run_worker_trial, write_verdict
    from batchfit.probe.keys import CacheKey, cache_key, probe_key
    from batchfit.probe.noise import check_noise_data, measure_noise
    from batchfit.probe.options import DEFAULT_MAX_BATCH, Options, positive_int, renamed
    from batchfit.probe.positions import check_seq_len, position_limit
    from batchfit.probe.prober import Prober
    from batchfit.probe.real_data import is_batch_source, worst_batch
    from batchfit.probe.state import Snapshot, take
    from batchfit.probe.trial import TrialRun, run_trial
    from batchfit.probe.workload import (
        AMP_DTYPES,
        Workload,
        call_model,
        call_model_explained,
        default_loss,
        optimizer_factory,
        own_loss,
        split_pair,
    )

_EXPORTS = {
    "batch_size_of": "batchfit.probe.batches",
    "map_tensors": "batchfit.probe.batches",
    "tensor_leaves": "batchfit.probe.batches",
    "tile": "batchfit.probe.batches",
    "to_device": "batchfit.probe.batches",
    "ResultCache": "batchfit.probe.cache",
    "open_cache": "batchfit.probe.cache",
    "CACHE_SCHEMA": "batchfit.probe.cache_files",
    "canonical_json": "batchfit.probe.cache_files",
    "check_entry": "batchfit.probe.cache_files",
    "entry_document": "batchfit.probe.cache_files",
    "write_atomically": "batchfit.probe.cache_files",
    "CacheKey": "batchfit.probe.keys",
    "cache_key": "batchfit.probe.keys",
    "probe_key": "batchfit.probe.keys",
    "check_callbacks": "batchfit.probe.checks",
    "check_materialised": "batchfit.probe.checks",
    "check_work": "batchfit.probe.checks",
    "fit_memory": "batchfit.probe.checks",
    "fixed_memory_advice": "batchfit.probe.checks",
    "loss_notes": "batchfit.probe.checks",
    "parameter_bytes": "batchfit.probe.checks",
    "Compiled": "batchfit.probe.compiled",
    "compile_notes": "batchfit.probe.compiled",
    "compile_seconds": "batchfit.probe.compiled",
    "compiled_info": "batchfit.probe.compiled",
    "mark_batch_dynamic": "batchfit.probe.compiled",
    "ProbeStartCallback": "batchfit.probe.finder",
    "StartCallback": "batchfit.probe.finder",
    "TrialCallback": "batchfit.probe.finder",
    "find_with": "batchfit.probe.finder",
    "search_with": "batchfit.probe.finder",
    "settings_of": "batchfit.probe.finder",
    "verdict": "batchfit.probe.finder",
    "LENGTH_CEILING": "batchfit.probe.frontier",
    "PointCallback": "batchfit.probe.frontier",
    "ProberFactory": "batchfit.probe.frontier",
    "check_lengths": "batchfit.probe.frontier",
    "frontier_with": "batchfit.probe.frontier",
    "JobPerTrial": "batchfit.probe.jobs",
    "run_worker_trial": "batchfit.probe.jobs",
    "write_verdict": "batchfit.probe.jobs",
    "check_noise_data": "batchfit.probe.noise",
    "measure_noise": "batchfit.probe.noise",
    "DEFAULT_MAX_BATCH": "batchfit.probe.options",
    "Options": "batchfit.probe.options",
    "positive_int": "batchfit.probe.options",
    "renamed": "batchfit.probe.options",
    "check_seq_len": "batchfit.probe.positions",
    "position_limit": "batchfit.probe.positions",
    "Prober": "batchfit.probe.prober",
    "is_batch_source": "batchfit.probe.real_data",
    "worst_batch": "batchfit.probe.real_data",
    "Snapshot": "batchfit.probe.state",
    "take": "batchfit.probe.state",
    "TrialRun": "batchfit.probe.trial",
    "run_trial": "batchfit.probe.trial",
    "AMP_DTYPES": "batchfit.probe.workload",
    "Workload": "batchfit.probe.workload",
    "call_model": "batchfit.probe.workload",
    "call_model_explained": "batchfit.probe.workload",
    "default_loss": "batchfit.probe.workload",
    "own_loss": "batchfit.probe.workload",
    "optimizer_factory": "batchfit.probe.workload",
    "split_pair": "batchfit.probe.workload",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_surface(__name__, globals(), _EXPORTS)
