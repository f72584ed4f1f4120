"""The soak: an epoch's batches, in the order a sampler forms them, run as real training steps.

Why: a bucket's batch is verified at its longest length and a budget at its worst compositions,
but a run lives through thousands of steps of changing shapes; on a caching allocator those
fragment the cache until a step that fitted at step 10 fails at step 10,000 (pytorch#130330,
verl #2159). The soak replays the sequence itself, one real step per batch, under the budget,
with the optimizer's state live from the first step, as the training run will: its first step
starts as a fresh process does (`TrialRequest.from_scratch`: nothing cached, a fresh optimizer),
and no cache is flushed between steps. It counts the steps that ran out of memory (and goes on:
a policy that fails is measured, not stopped), the peak and the step where it was, and on a
caching allocator its retries and the growth of reserved memory per 100 steps. Between its steps
the cache is kept (`ShapedTrials.cache_kept`), where a search's trials empty it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from batchfit.probe.keywords import TrialCallback
from batchfit.probe.lengths import ProberFactory
from batchfit.probe.options import Options
from batchfit.probe.shaped import shaped_trials
from batchfit.report.varlen import Soak
from batchfit.units import positive_int

__all__ = ["checked_steps", "soak_with"]

#: Steps before the drift is counted (half of a shorter soak): the first ones grow the cache to its working size.
WARM_STEPS = 100


def soak_with(
    make_batch: Callable[[int, int], Any],
    shapes: Iterable[tuple[int, int]],
    options: Options,
    make_prober: ProberFactory,
    sampler: str,
    *,
    max_steps: int | None = None,
    callback: TrialCallback | None = None,
) -> Soak:
    """Replay ``shapes`` (``(rows, seq_len)`` per step, a sampler's epoch) as real steps; the
    first ``max_steps`` of them when given. ``sampler`` names what formed them, for the record."""
    plan = checked_steps(shapes, sampler, max_steps)
    started = time.monotonic()
    oom, peak, peak_step = 0, -1, 0
    reserved: list[int] = []
    retries: list[int] = []
    with shaped_trials(make_batch, options.untimed(), make_prober, f"a step of the {sampler} soak") as trials:
        counts, carries = trials.setup.counts, trials.setup.traits.layout_carries
        trial = trials.run(*plan[0], steps=1, from_scratch=True)  # as a fresh process starts
        with trials.cache_kept():  # from here the cache is the run's: nothing flushed between steps
            for step, (rows, seq_len) in enumerate(plan, 1):
                if step > 1:
                    trial = trials.run(rows, seq_len, steps=1)
                if callback is not None:
                    callback(trial)
                oom += not trial.fits
                seen = trial.peak_in(counts) or 0
                if seen > peak:
                    peak, peak_step = seen, step
                reserved.append(trial.reserved_peak_bytes or 0)
                retries.append(0 if trial.allocator is None else trial.allocator.retries)
        budget = trials.setup.budget_bytes
    warm = min(WARM_STEPS, len(plan) // 2)  # a short soak: its first half warms the cache
    counted = len(plan) - warm
    per_100 = (lambda total: total * 100 / counted) if carries and counted > 0 and warm > 0 else None
    return Soak(
        sampler=sampler,
        steps=len(plan),
        oom=oom,
        peak_bytes=max(peak, 0),
        peak_step=peak_step,
        peak_shape=plan[peak_step - 1] if peak_step else plan[0],
        budget_bytes=budget,
        retries_per_100=None if per_100 is None else per_100(sum(retries[warm:])),
        reserved_drift_per_100=None if per_100 is None else per_100(max(reserved[warm:]) - reserved[warm - 1]),
        seconds=time.monotonic() - started,
    )


def checked_steps(
    shapes: Iterable[tuple[int, int]], sampler: str, max_steps: int | None = None
) -> list[tuple[int, int]]:
    """The steps a soak replays, checked before any of them runs: each ``(rows, seq_len)`` a
    positive int pair, the first ``max_steps`` when given, at least one (a ``ValueError`` naming
    the step); a soak in a fresh process checks them here before the process starts."""
    if max_steps is not None:
        max_steps = positive_int("max_steps", max_steps)
    plan = []
    for step, shape in enumerate(shapes):
        if max_steps is not None and step >= max_steps:
            break
        rows, seq_len = shape
        plan.append((positive_int(f"step {step + 1}'s rows", rows), positive_int(f"step {step + 1}'s length", seq_len)))
    if not plan:
        raise ValueError(f"the soak of {sampler} has no steps to replay")
    return plan
