"""How `search_with` searches (`SearchPlan`); what runs its trials is a `Runner` (`batchfit.probe.runner`).

A `SearchPlan` says how the boundary is searched: `FromInit`, `find`'s search from `init_batch`, or
the frontier's from the boundary its surface predicts (`batchfit.probe.lengths`) and checkpointing's
from the line its other policies predict (`batchfit.probe.checkpointing_search`): both `FromLine`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol, runtime_checkable

from batchfit.probe.safe_batch import STEP_DOWN, safe_cap
from batchfit.report import MemoryModel, PhaseLine, Trial, Unit
from batchfit.search import Attempt, Grid, SearchReport, Strategy, search, search_near

__all__ = ["ANCHOR_MARGIN", "FromInit", "FromLine", "Oracle", "SearchPlan"]

#: The verification that opens a search from a predicted line aims this fraction below the safe batch
#: the line predicts: a verification that fails under the lowered cap is a wasted trial, one a little
#: low is kept when the memory line's candidate is within ``STEP_DOWN`` (3%) above it.
ANCHOR_MARGIN = 0.01

#: `oracle(batch_size, kind="search")`: a trial as the search sees it (`SearchRun.oracle` in
#: `batchfit.probe.finder`); `kind="verify"` runs the safe batch's verification at that size.
Oracle = Callable[..., Attempt]


@runtime_checkable
class SearchPlan(Protocol):
    """How `search_with` finds the boundary, aims the safe batch where the trials fit no memory
    line, and keeps a verification the search ran: `FromInit` (`find`'s), or the frontier's search
    from its surface (`batchfit.probe.lengths`)."""

    @property
    def keep_verified_within(self) -> float:
        """A verification the search ran stays the safe batch when the memory line's candidate is
        at most this fraction above it (`safe_batch`); 0 for `find`."""
        ...

    def search(
        self, oracle: Oracle, grid: Grid, *, should_stop: Callable[[], bool], budget_bytes: int | None
    ) -> SearchReport:
        """The boundary, found by trials `oracle(b)`.

        Args:
            oracle: a trial as the search sees it; `oracle(b, kind="verify")` runs the safe batch's
                verification at `b` instead, which `safe_batch` then finds done.
            grid: the sizes the search may try.
            should_stop: whether the time budget ran out (every rank alike).
            budget_bytes: the memory the trials may use, in the unit of the verdicts' peaks.
        """
        ...

    def memory_hint(self, trials: list[Trial], budget: int | None, unit: Unit) -> MemoryModel | None:
        """The memory equation where the trials measured fewer than two fitting sizes, else `None`."""
        ...


class FromInit:
    """`find`'s search: the pure search from `init_batch` with the options' strategy, no hint, no
    verification kept from the search."""

    keep_verified_within = 0.0

    def __init__(self, strategy: Strategy) -> None:
        #: `batchfit.search.search` itself, the strategy bound (a partial, not a method: no frame of
        #: its own between `find` and the model).
        self.search = partial(search, strategy=strategy)

    def memory_hint(self, trials: list[Trial], budget: int | None, unit: Unit) -> MemoryModel | None:
        """No hint: without a memory line the safe batch is chosen from the trials alone (`safe_batch`)."""
        return None


@dataclass(frozen=True)
class FromLine:
    """The search from the boundary a predicted memory line (``fixed_bytes + b x per_sample_bytes``)
    gives (a `SearchPlan`; each prediction is appended to `predicted`), and that line's slope for
    the memory equation when the search measured only one fitting size. The frontier predicts the
    line at a further length from its surface; checkpointing at a further policy from the
    policies measured (`batchfit.probe.checkpointing_search`).

    The search's first trial is the safe batch's verification (where `verifies`), at the safe
    batch the line predicts (the largest under `(1 - headroom) x budget`): it verifies the safe
    batch and gives the Newton step to the boundary its measured point, one trial for two jobs. So a
    prediction that holds costs three trials (the verification, the boundary, one more), the
    trials a `find()` must run there at the least. The verification is kept as the safe batch when
    the memory line's own candidate is at most `STEP_DOWN` above it (not verified again)."""

    fixed_bytes: float
    per_sample_bytes: float
    headroom: float
    hedge: float
    verifies: bool
    predicted: list[float]
    keep_verified_within: float = STEP_DOWN

    def largest_batch(self, budget_bytes: float) -> float:
        """The batch (a real number) where the line meets ``budget_bytes``."""
        slope = self.per_sample_bytes
        return math.inf if slope <= 0 else (budget_bytes - self.fixed_bytes) / slope

    def search(
        self, oracle: Oracle, grid: Grid, *, should_stop: Callable[[], bool], budget_bytes: int | None
    ) -> SearchReport:
        """`search_near` from the predicted boundary, its anchor the predicted safe batch's verification."""
        budget = budget_bytes
        guess = self.largest_batch(budget) if budget is not None else grid.init
        self.predicted.append(guess)
        anchor = None
        if self.verifies and budget is not None:
            aimed = (1 - ANCHOR_MARGIN) * self.largest_batch(safe_cap(budget, self.headroom))
            safe = grid.floor(math.floor(min(aimed, guess))) if math.isfinite(min(aimed, guess)) else grid.top
            if grid.init <= safe < guess:
                anchor = (safe, partial(oracle, kind="verify"))
        slope = self.per_sample_bytes
        return search_near(oracle, grid, guess, slope, budget, should_stop, hedge=self.hedge, anchor=anchor)

    def memory_hint(self, trials: list[Trial], budget: int | None, unit: Unit) -> MemoryModel | None:
        """The line's slope through the largest fitting trial."""
        slope = self.per_sample_bytes
        fitted = [t for t in trials if t.fits and t.peak_in(unit) is not None]
        if not fitted or slope <= 0:
            return None
        top = max(fitted, key=lambda t: t.batch_size)
        phase = max(top.phase_peaks_in(unit), key=lambda pair: pair[1], default=("forward", 0))[0]
        line = PhaseLine(phase, (top.peak_in(unit) or 0) - slope * top.batch_size, slope)
        return MemoryModel(
            fixed_bytes=round(line.fixed_bytes), per_sample_bytes=slope, phase=line.phase, lines=(line,), unit=unit
        )
