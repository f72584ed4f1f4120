"""The runner seam: the one interface every way of running trials implements (`Runner`), and `opened`.

As narrow as httpx's transport: a runner opens a probe (`Setup`: the budget, the device, the
ranks, what it can do), runs a trial request (`TrialRequest` -> `Trial`), settles the budget and
the memory equation after the search (`Settled`), and closes with its findings (`Findings`: the
notes, the fixed memory's advice, each rank's own answer). `search_with`
(`batchfit.probe.finder`) asks nothing else of a runner and never asks which one it holds. The
runners: the real [`Prober`][batchfit.Prober], a job per trial (`batchfit.probe.job_runner`), fake
trials and fake ranks (`batchfit.estimation.fake_trials`, `fake_ranks`). A new way to run trials
is one class with these four methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from batchfit.report import DeviceInfo, MemoryModel, RankBatch, SizedOn, Trial, TrialKind, Unit
from batchfit.search import Grid

if TYPE_CHECKING:
    from batchfit.distributed import Solo  # the seam itself loads no torch: the gate's module imports it

__all__ = ["Findings", "GroupAnswer", "Runner", "Settled", "Setup", "Traits", "TrialRequest", "opened"]


@dataclass(frozen=True)
class Traits:
    """What a runner's trials can do, which changes how the search runs them."""

    #: The optimizer kept between trials carries its memory layout: the largest fit is tried
    #: again from scratch (`batchfit.search.scratch`).
    layout_carries: bool = False
    #: The meter's bookkeeping slows every step (the CPU's live-tensor meter): a timed step runs
    #: without it, after the steps it measures.
    slows_steps: bool = False
    #: Sizes can be timed warm after the search (`batchfit.probe.timing`): one process keeps running.
    times_warm: bool = False


@dataclass(frozen=True)
class Setup:
    """What a runner tells the search once it is open."""

    #: The memory the trials may use, in the unit of `counts`.
    budget_bytes: int | None
    #: Which memory the budget counts (`"reserved"` on caching allocators).
    counts: Unit
    #: The device the trials run on, for the result.
    device: DeviceInfo
    #: The processes that probe together: they stop at the same point.
    ranks: Solo
    #: The memory limit as resolved, where it came from, and what was set aside outside the allocator.
    limit_bytes: int | None
    limit_source: str
    reserve_bytes: int
    traits: Traits
    #: Which batch of real data the sizes are built from, or `None`.
    sized_on: SizedOn | None = None
    #: What the result should say about the set-up.
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrialRequest:
    """One trial: `batch_size`, `steps` (`None`: the runner's own count), what it is for (`kind`),
    a fresh optimizer, a lower cap (the safe batch's verification), or a replay of a fresh
    training process (`from_scratch`: a fresh optimizer; on a caching allocator nothing cached)."""

    batch_size: int
    steps: int | None = None
    kind: TrialKind = "search"
    fresh_optimizer: bool = False
    cap_bytes: int | None = None
    from_scratch: bool = False


@dataclass(frozen=True)
class Settled:
    """The budget after the search (`reserve="auto"` measured again) and the memory equation."""

    budget_bytes: int | None
    limit_bytes: int | None
    limit_source: str
    reserve_bytes: int
    memory: MemoryModel | None
    #: What the runner learnt during the trials and the settling, for the result.
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class GroupAnswer:
    """The group's answer, which a runner over ranks with different budgets searches on from
    (`batchfit.probe.per_rank`)."""

    grid: Grid
    largest: int
    safe: int
    verified: bool
    verify_steps: int
    headroom: float
    out_of_time: Callable[[], bool]


@dataclass(frozen=True)
class Findings:
    """What a runner says once closed."""

    #: What the result should say (compilation, the meter, the ranks).
    notes: tuple[str, ...] = ()
    #: What to say when not even `init_batch` fits and the fixed memory is the reason.
    fixed_advice: str | None = None
    #: Each rank's own answer where the ranks' budgets differ, and its note.
    per_rank: tuple[RankBatch, ...] = ()
    per_rank_notes: tuple[str, ...] = ()


@runtime_checkable
class Runner(Protocol):
    """What `search_with` asks of a way to run trials (see the module docs)."""

    def open(self) -> Setup:
        """Set the probe up (the user's objects snapshotted, the limit applied); undo it all if that fails."""
        ...

    def run(self, request: TrialRequest) -> Trial:
        """One trial."""
        ...

    def settle(self, trials: Sequence[Trial]) -> Settled:
        """The budget after the search and the memory equation fitted on ``trials``."""
        ...

    def close(self, trials: Sequence[Trial], answer: GroupAnswer | None, exc: BaseException | None) -> Findings:
        """Undo everything (whatever ``exc`` ended the probe, Ctrl-C included); with the group's
        ``answer`` and no ``exc``, each rank's own answer first where the runner can."""
        ...


class opened:  # noqa: N801 (a context manager named as `contextlib.closing` is)
    """``with opened(runner, trials) as setup:``: `Runner.open`, and `Runner.close` however the block
    ends (its `Findings` in `findings`). A class, not a generator: its ``__exit__`` is a frame a
    runner's interrupt guard can name as a way out (``InterruptGuard(exits=...)``), so a second
    Ctrl-C there cannot skip the close. ``answer``: set by the caller before the block ends."""

    def __init__(self, runner: Runner, trials: Sequence[Trial] = ()) -> None:
        self.runner, self.trials = runner, trials
        self.answer: GroupAnswer | None = None
        self.findings: Findings | None = None

    def __enter__(self) -> Setup:
        return self.runner.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.findings = self.runner.close(self.trials, self.answer, exc)
