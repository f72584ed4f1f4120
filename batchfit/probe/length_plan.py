"""Batch sizes for variable-length data: what [`batchfit.buckets`][batchfit.buckets] does.

`plan_lengths` reads top to bottom as the answer is built:

1. the candidate bucket ends: row quantiles of the data's lengths (heavier in the tail) and the
   longest, or the ``boundaries`` given (`batchfit.report.bucketing.candidate_lengths`);
2. the frontier over them (`frontier_with`): at each, the exact largest batch, the safe batch
   verified by real steps, and its tokens/s; so every bucket's batch is exact at its longest
   length, where its padded rows are;
3. the buckets: at most ``max_buckets`` of those ends, the set that makes the epoch fastest at
   the measured rates (`choose_buckets`);
4. the token budget: the largest padded ``max_tokens`` whose every batch (``max_tokens // s``
   rows of each length ``s`` of the data) holds no more rows than that length takes
   (`propose_budget`: measured where measured, the surface between, kept between the measured
   neighbours), then its worst compositions run for real under the safe cap: rows at the longest
   length, as many shortest rows as it admits, the binding length's, the surface's fullest. A
   composition that does not fit is a measurement: the budget is proposed again below it;
5. packing (``pack_length``): the frontier of packed rows at that length (the largest batch of
   packed rows, and the longest single packed row, a flattening collator's budget).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from batchfit.probe.keywords import ProbeStartCallback, StartCallback, TrialCallback
from batchfit.probe.lengths import PointCallback, ProberFactory, frontier_with
from batchfit.probe.options import Options
from batchfit.probe.packing import check_takes_positions, packed_batches
from batchfit.probe.safe_batch import safe_cap
from batchfit.probe.shaped import shaped_trials
from batchfit.report import Frontier, LengthPlan
from batchfit.report.bucketing import (
    Measured,
    candidate_lengths,
    choose_buckets,
    compositions,
    greedy_steps,
    median_of,
    pack_fill,
    propose_budget,
)
from batchfit.report.varlen import Composition, Packing, TokenBudget

__all__ = ["plan_lengths"]

#: Times the budget is proposed again below a composition that did not fit, before the
#: measured points alone (no surface between them) decide it.
REPROPOSALS = 4


def plan_lengths(
    model: nn.Module,
    make_batch: Callable[[int, int], Any],
    histogram: Mapping[int, int],
    options: Options,
    make_prober: ProberFactory,
    *,
    boundaries: Sequence[int] | None = None,
    max_buckets: int,
    token_budget: bool = True,
    pack_length: int | None = None,
    world_size: int = 1,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
    on_point: PointCallback | None = None,
    on_length: Callable[[int | None], None] | None = None,
) -> LengthPlan:
    """The plan for ``histogram`` (``{length: rows}``; see the module). ``make_prober`` builds a
    runner from options, as for `frontier_with`; the hooks are the frontier's."""
    longest = max(histogram)
    if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
        raise ValueError(f"max_buckets must be an int >= 1, got {max_buckets!r}")
    if pack_length is not None:
        check_takes_positions(model)  # before any trial
        if pack_length < longest:
            raise ValueError(
                f"pack_length={pack_length} is shorter than the longest row ({longest}): packing does not cut rows"
            )
    ends = _ends(histogram, boundaries, options.multiple_of)
    hooks: dict[str, Any] = {"callback": callback, "on_trial_start": on_trial_start}
    frontier = frontier_with(
        model,
        make_batch,
        ends,
        options,
        make_prober,
        longest_at_batch_1=False,
        on_start=on_start,
        on_point=on_point,
        on_length=on_length,
        **hooks,
    )
    measured = [
        Measured(p.seq_len, p.safe_batch, p.max_batch, None if not p.tokens_per_s else p.tokens_per_s / p.seq_len)
        for p in frontier.points
    ]
    notes: list[str] = []
    buckets = choose_buckets(histogram, measured, max_buckets, world_size)
    budget = None
    if token_budget:
        budget = _token_budget(make_batch, histogram, frontier, options, make_prober, world_size, notes, hooks)
    packing = None
    if pack_length is not None:
        packing = _packing(model, make_batch, histogram, pack_length, options, make_prober, on_start, hooks)
    return LengthPlan(
        buckets=buckets,
        token_budget=budget,
        packing=packing,
        frontier=frontier,
        rows=sum(histogram.values()),
        shortest=min(histogram),
        median=median_of(histogram),
        longest=longest,
        world_size=world_size,
        notes=tuple(notes),
    )


def _ends(histogram: Mapping[int, int], boundaries: Sequence[int] | None, multiple_of: int) -> tuple[int, ...]:
    """The candidate bucket ends: the ones given (checked to cover the longest row), else the quantiles'."""
    if boundaries is None:
        return candidate_lengths(histogram, multiple_of)
    if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, Sequence) or not boundaries:
        raise TypeError(f"boundaries must be a non-empty sequence of lengths, got {boundaries!r}")
    ends = sorted(set(boundaries))
    if ends[-1] < max(histogram):
        raise ValueError(
            f"boundaries end at {ends[-1]}, below the longest row ({max(histogram)}): its bucket would be missing"
        )
    return tuple(ends)


def _token_budget(
    make_batch: Callable[[int, int], Any],
    histogram: Mapping[int, int],
    frontier: Frontier,
    options: Options,
    make_prober: ProberFactory,
    world_size: int,
    notes: list[str],
    hooks: dict[str, Any],
) -> TokenBudget | None:
    """The largest padded budget whose worst compositions ran under the safe cap (see the module)."""
    budget = frontier.budget_bytes
    cap = None if budget is None else safe_cap(budget, options.headroom)
    surface = frontier.surface
    predicted = None
    predicted_bytes = None
    if surface is not None and cap is not None:
        predicted = lambda s: surface.largest_batch(s, cap)  # noqa: E731
        predicted_bytes = lambda rows, s: surface.predict(rows, s) / cap  # noqa: E731
    safe = {point.seq_len: point.safe_batch for point in frontier.points}
    ran: dict[tuple[int, int], Composition] = {}
    with shaped_trials(make_batch, options.untimed(), make_prober, "a composition of the token budget") as trials:
        for attempt in range(REPROPOSALS + 1):
            max_tokens, binding = propose_budget(histogram, safe, predicted if attempt < REPROPOSALS else None)
            if max_tokens < max(histogram):
                notes.append(
                    f"no padded token budget holds both the longest row ({max(histogram):,}) and the short rows it "
                    f"admits ({max_tokens // binding + 1} rows of {binding:,} do not fit): size buckets instead"
                )
                return None
            worst = compositions(histogram, max_tokens, binding, predicted_bytes)
            failed = None
            for rows, seq_len, kind in worst:
                if (rows, seq_len) not in ran:
                    if hooks["on_trial_start"] is not None:
                        hooks["on_trial_start"](rows, "verify")
                    trial = trials.run(rows, seq_len, cap_bytes=cap)
                    if hooks["callback"] is not None:
                        hooks["callback"](trial)
                    peak = trial.peak_in(trials.setup.counts)
                    guess = None if surface is None else max(0, round(surface.predict(rows, seq_len)))
                    ran[(rows, seq_len)] = Composition(rows, seq_len, kind, trial.fits, peak, guess)
                if not ran[(rows, seq_len)].fits:
                    failed = (rows, seq_len)
                    break
            if failed is None:
                kept = tuple(ran[(rows, seq_len)] for rows, seq_len, _ in worst)
                rejected = tuple(c for c in ran.values() if not c.fits)
                steps = greedy_steps(histogram, max_tokens, world_size)
                return TokenBudget(max_tokens, binding, kept, steps, rejected)
            rows, seq_len = failed
            if rows <= 1:
                raise RuntimeError(
                    f"one row of {seq_len:,} tokens did not fit under the safe cap, though the frontier's did"
                )
            safe[seq_len] = min(safe.get(seq_len, math.inf), rows - 1)  # type: ignore[type-var]
            notes.append(f"the token budget was proposed again: {rows} rows of {seq_len:,} tokens did not fit")
    return None


def _packing(
    model: nn.Module,
    make_batch: Callable[[int, int], Any],
    histogram: Mapping[int, int],
    pack_length: int,
    options: Options,
    make_prober: ProberFactory,
    on_start: ProbeStartCallback | None,
    hooks: dict[str, Any],
) -> Packing:
    """Packed rows of ``pack_length``: their exact and safe batch, the longest packed row at batch 1."""
    packed = packed_batches(make_batch, histogram)
    frontier = frontier_with(model, packed, [pack_length], options, make_prober, longest_at_batch_1=True, **hooks)
    point = frontier.points[0]
    fill = pack_fill(histogram, pack_length)
    return Packing(
        pack_length=pack_length,
        batch_size=point.safe_batch,
        max_batch=point.max_batch,
        longest_packed_row=frontier.longest_at_batch_1,
        fill=fill,
        tokens_per_s=None if point.tokens_per_s is None else point.tokens_per_s * fill,
        longest_limited_by=frontier.longest_limited_by,
    )
