"""The notes of a result: what the trials showed that a reader of the answer should know."""

from __future__ import annotations

from collections.abc import Sequence

from batchfit.backends.allocator_rule import facts_notes
from batchfit.probe.safe_batch import safe_cap
from batchfit.report import MemoryModel, Trial
from batchfit.search import Attempt, SearchReport, is_non_monotone
from batchfit.units import format_bytes


def ranks_notes(world_size: int, said: list[str]) -> list[str]:
    """Say what a batch size means when several ranks probed together, then what the runner
    ``said`` about its ranks (nothing for one rank)."""
    if world_size == 1:
        return []
    return [
        f"probed on {world_size} ranks together: batch sizes are per rank (the global batch is {world_size} x that), "
        "a size fits only where it fitted on every rank, peaks are the largest rank's, samples/s are the whole "
        "group's (the slowest rank's step)",
        *said,
    ]


def evidence(trials: Sequence[Trial], largest_fit: int) -> list[Trial]:
    """The trials that speak about the budget: not those run under a lower cap (the safe batch's
    verification), nor fits above the largest fit that trials from scratch overruled, nor warm failures
    at or below a size a replay of a fresh process fitted (the boundary from scratch moved up)."""
    budget = [t for t in trials if t.cap_bytes is None]
    replayed = max((t.batch_size for t in budget if t.replay and t.fits), default=0)
    return [
        t
        for t in budget
        if not (t.fits and t.batch_size > largest_fit) and (t.fits or t.replay or t.batch_size > replayed)
    ]


def non_monotone(trials: Sequence[Trial], largest_fit: int) -> bool:
    """Whether a size failed although a larger one fitted, among the trials that speak about the
    budget (`evidence`): the probe's ``Result.non_monotone``, and what a stored one must show."""
    return is_non_monotone([Attempt(t.batch_size, t.fits) for t in evidence(trials, largest_fit)])


def trial_notes(trials: list[Trial], report: SearchReport) -> list[str]:
    """What the trials showed that a reader should know: odd memory, leaks, fp16 skips."""
    notes: list[str] = []
    if non_monotone(trials, report.largest_fit):
        notes.append("memory was not monotone in batch size: a size failed although a larger one fitted")
    notes += [
        f"trial at batch {t.batch_size} left {format_bytes(t.leaked_bytes)} allocated after release"
        for t in trials
        if t.leaked_bytes
    ]
    skipped = sum(t.skipped_steps for t in trials)
    if skipped:
        notes.append(
            f"fp16: the GradScaler skipped {skipped} optimizer step(s), which did not count: every trial ran until "
            "its optimizer stepped (see docs/concepts/one-trial.md#one-trial)"
        )
    if not report.boundary_reached:
        notes.append(
            f"no size ran out of memory up to {report.largest_fit} ({report.stop_reason}): "
            "the true maximum may be larger"
        )
    return notes


def equation_notes(memory: MemoryModel | None, report: SearchReport, budget: int | None) -> list[str]:
    """Say so when the memory equation calls the size that ran out of memory a fit: then it
    must not be trusted near the boundary (the measured trials are what counts)."""
    failed = report.smallest_fail
    if memory is None or budget is None or failed is None or memory.predict(failed) > budget:
        return []
    return [
        f"the memory equation predicts {format_bytes(memory.predict(failed))} for batch {failed}, within the "
        f"budget, but batch {failed} ran out of memory: do not extrapolate the equation near the boundary"
    ]


def allocator_notes(
    trials: Sequence[Trial], largest_fit: int, budget: int | None, headroom: float, varies: str | None = None
) -> list[str]:
    """What the allocator did at the largest batch that a reader should know (`facts_notes`): retries only
    reported (expandable segments), split-free bytes beyond the headroom, and data whose lengths vary
    (``varies``: the tensor whose length does), where the advice is expandable segments."""
    at_max = (t.allocator for t in reversed(trials) if t.fits and t.batch_size == largest_fit and t.allocator)
    facts = next(at_max, None)
    notes = facts_notes(facts, None if budget is None else budget - safe_cap(budget, headroom))
    if facts is not None and facts.rule == "native" and varies is not None:
        notes.append(
            f"the data's lengths vary ({varies}): on the native allocator the blocks of one length are cut to "
            "fit the next and fragment over an epoch; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True avoids "
            "that (see docs/concepts/measuring.md#what-fits-on-cuda)"
        )
    return notes
