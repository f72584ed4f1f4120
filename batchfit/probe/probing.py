"""What `search_with` takes: the prober its trials run on (`ProbesTrials`) and how it searches (`SearchPlan`).

`search_with` runs over three probers: the real [`Prober`][batchfit.Prober], a job per trial
(`batchfit.probe.jobs`) and fake trials (`batchfit.estimation`); each is a `ProbesTrials`
(`tests/test_call_path.py` checks it member by member). A `SearchPlan` says how the boundary is
searched: `FromInit`, `find`'s search from `init_batch`, or the frontier's from the boundary its
surface predicts (`batchfit.probe.frontier`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

from batchfit.distributed import Solo
from batchfit.report import DeviceInfo, MemoryModel, SizedOn, Trial, TrialKind, Unit
from batchfit.search import Attempt, Grid, SearchReport, Strategy, search

__all__ = ["FromInit", "Oracle", "ProbesTrials", "SearchPlan"]

#: `oracle(batch_size, kind="search")`: a trial as the search sees it (`SearchRun.oracle` in
#: `batchfit.probe.finder`); `kind="verify"` runs the safe batch's verification at that size.
Oracle = Callable[..., Attempt]


@runtime_checkable
class ProbesTrials(Protocol):
    """What `search_with` asks of a prober: a context manager that sets a probe up, runs its
    trials and undoes everything on the way out. Its attributes are read once it is entered."""

    def __enter__(self) -> Any: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def trial(
        self,
        batch_size: int,
        steps: int | None = None,
        kind: TrialKind = "search",
        fresh_optimizer: bool = False,
        cap_bytes: int | None = None,
    ) -> Trial:
        """One trial at `batch_size`.

        Args:
            batch_size: the size to try.
            steps: the steps to run; `None` for the prober's own count.
            kind: what the trial is for, recorded in it.
            fresh_optimizer: start as a new process does, no optimizer state kept.
            cap_bytes: run under this lower limit (the safe batch's verification).
        """
        ...

    @property
    def ranks(self) -> Solo:
        """The processes that probe together: they stop at the same point."""
        ...

    @property
    def budget_bytes(self) -> int | None:
        """The memory the trials may use, in the unit of `counts`."""
        ...

    @property
    def counts(self) -> Unit:
        """Which memory the budget counts (`"reserved"` on caching allocators)."""
        ...

    @property
    def device_info(self) -> DeviceInfo:
        """The device the trials ran on, for the result."""
        ...

    @property
    def notes(self) -> list[str]:
        """What the result should say about the set-up; `search_with` adds its own."""
        ...

    @property
    def limit_bytes(self) -> int | None:
        """The memory limit as resolved, for the result's settings."""
        ...

    @property
    def limit_source(self) -> str:
        """Where the limit came from, for the result's settings."""
        ...

    @property
    def reserve_bytes(self) -> int:
        """What was set aside for memory outside the allocator."""
        ...

    @property
    def layout_carries(self) -> bool:
        """Whether the optimizer kept between trials carries its memory layout: the largest fit is
        then tried again from scratch (`batchfit.search.scratch`)."""
        ...

    @property
    def slows_steps(self) -> bool:
        """Whether the meter's bookkeeping slows every step (the CPU's live-tensor meter): a timed
        step then runs without it, after the steps it measures (`Meter.unobserved`)."""
        ...

    @property
    def times_warm(self) -> bool:
        """Whether its trials can time sizes warm after the search (`batchfit.probe.timing`): one
        process keeps running, unlike a job per trial or fake trials."""
        ...

    @property
    def sized_on(self) -> SizedOn | None:
        """Which batch of real data the sizes are built from, or `None`."""
        ...

    def memory_model(self, trials: list[Trial]) -> MemoryModel | None:
        """The memory equation fitted on `trials`, in the unit the budget counts."""
        ...

    def fixed_advice(self) -> str | None:
        """What to say when not even `init_batch` fits and the fixed memory is the reason."""
        ...

    def settle_reserve(self) -> int | None:
        """The budget after the search, once the memory outside the allocator was measured again."""
        ...

    def compile_notes(self, trials: list[Trial]) -> list[str]:
        """What to say about a `torch.compile`d model."""
        ...

    def meter_notes(self) -> list[str]:
        """What the meter has to say about how it counted."""
        ...

    def ranks_notes(self) -> list[str]:
        """What the ranks have to say about the model."""
        ...


@runtime_checkable
class SearchPlan(Protocol):
    """How `search_with` finds the boundary, aims the safe batch where the trials fit no memory
    line, and keeps a verification the search ran: `FromInit` (`find`'s), or the frontier's search
    from its surface (`batchfit.probe.frontier`)."""

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
