"""Each rank's own max and safe batch, when the ranks of one probe have different budgets (`per_rank`).

The group's search stops where the *smallest* rank runs out of memory (a trial fits only where it
fits on every rank, ``batchfit.distributed.ranks``), so it measures each rank's own peaks at every
size it tried but only the smallest rank's boundary. With mixed cards (or a rank sharing its device)
the others fit more, and an uneven split of one global batch can use it
(``Result.recommend(uneven=True)``). So after the group's answer, in the same probe:

1. every rank's budget is gathered; alike, there is nothing more to find;
2. the ranks that have not seen their own boundary search on from the group's largest batch, all in
   the same trials (DDP steps the same model with any micro-batch per rank): each at the size its
   own peaks predict for its budget, then halving the gap once a prediction missed. A rank that
   knows its answer runs ``init_batch`` meanwhile (it fits: the group fitted it). A trial that
   fails tells the ranks that ran out of memory themselves (the meetings say which); a rank that
   only heard of another's tries its size again;
3. each rank's safe batch is the largest its own peaks put under its budget less the headroom
   (never below the group's verified safe batch), verified with every rank at its own safe batch
   in the same trial, under its own lowered cap: the uneven split itself. A rank whose size fails
   steps down; one that never passes keeps the group's safe batch, marked not verified.

These trials are not the group's: they are left out of ``Result.trials`` (whose sizes are every
rank's) and said in a note. Only the in-process `Prober` over several ranks runs this, as the last
step of its `close` (`batchfit.probe.runner`): a job per trial (``batchfit.probe.job_runner``) and an
estimate have no per-rank meter.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from batchfit.distributed import Solo
from batchfit.distributed.ranks import Group
from batchfit.probe.runner import GroupAnswer, TrialRequest
from batchfit.probe.safe_batch import ATTEMPTS, STEP_DOWN, safe_cap
from batchfit.report import RankBatch, Trial, Unit
from batchfit.search import Grid
from batchfit.units import format_bytes

__all__ = ["per_rank"]

#: Search rounds at most (each one trial on every rank): a predicted boundary takes two.
MAX_ROUNDS = 12
#: The largest fitting sizes a rank's own line is drawn through.
LINE_POINTS = 3


def per_rank(
    ranks: Solo, run: Callable[[TrialRequest], Trial], unit: Unit, budget: int | None, group: GroupAnswer
) -> tuple[tuple[RankBatch, ...], list[str]]:
    """Every rank's `RankBatch` and a note, or ``((), [])`` where the ranks' budgets are alike (see
    the module docs): the last step of `Prober.close`. ``run``: a trial on every rank; ``budget``:
    this rank's; ``group``: the group's answer."""
    if not isinstance(ranks, Group):
        return (), []
    budgets = ranks.gather(budget, "gathering every rank's budget")
    if None in budgets or len(set(budgets)) == 1:
        return (), []
    assert budget is not None
    grid, safe, verify_steps, headroom = group.grid, group.safe, group.verify_steps, group.headroom
    started = len(ranks.history)
    own = _Own(ranks, unit, grid, budget, group.largest)
    rounds = 0
    while ranks.any(not own.done) and not group.out_of_time() and rounds < MAX_ROUNDS:
        size = grid.init if own.done else own.next_size()
        trial = run(TrialRequest(size))
        if not own.done:
            own.learn(size, trial)
        rounds += 1
    mine, mine_verified = own.safe_candidate(safe_cap(budget, headroom), safe), False
    for _ in range(ATTEMPTS if verify_steps else 0):
        under = safe_cap(budget, headroom) if mine > grid.init else None
        check = run(TrialRequest(mine, verify_steps, "verify", fresh_optimizer=verify_steps >= 2, cap_bytes=under))
        if check.fits:
            mine_verified = True
            break
        if ranks.rank in ranks.history[-1][1]:  # this rank ran out of memory itself: step down
            mine = max(safe, grid.floor(math.floor(mine * (1 - STEP_DOWN))))
    if not mine_verified and verify_steps:
        mine, mine_verified = safe, group.verified  # the group's safe batch, verified under a cap below this rank's
    answer = (mine, mine_verified, own.lo, own.boundary)
    answers = ranks.gather(answer, "gathering every rank's own answer")
    records = tuple(
        RankBatch(rank=r, max_batch=lo, safe_batch=s, budget_bytes=b, safe_verified=v, boundary_reached=reached)
        for r, ((s, v, lo, reached), b) in enumerate(zip(answers, budgets))
    )
    said = "; ".join(f"rank {a.rank} max {a.max_batch}, safe {a.safe_batch}" for a in records)
    trials = len(ranks.history) - started
    note = (
        f"the ranks' budgets differ ({', '.join(format_bytes(b) for b in budgets)}): each rank's own batch sizes "
        f"were found in {trials} more trial{'s' * (trials != 1)}, left out of the trials above: {said} "
        "(Result.per_rank; recommend(uneven=True) splits a global batch by them)"
    )
    return records, [note]


class _Own:
    """This rank's search from the group's largest batch: what fitted it, where it ran out itself."""

    def __init__(self, ranks: Group, unit: Unit, grid: Grid, budget: int, largest: int) -> None:
        self.rank, self.grid, self.budget = ranks.rank, grid, budget
        self.history = ranks.history
        self.unit = unit
        self.lo = largest
        self.hi: int | None = None
        self.missed = False
        for trials, out_of_memory in ranks.history:
            mine = trials[self.rank]
            if self.rank in out_of_memory and mine.kind != "verify" and mine.batch_size > largest:
                self.hi = mine.batch_size if self.hi is None else min(self.hi, mine.batch_size)

    @property
    def boundary(self) -> bool:
        return self.hi is not None and self.lo + self.grid.multiple_of >= self.hi

    @property
    def done(self) -> bool:
        return self.boundary or self.lo + self.grid.multiple_of > self.grid.top

    def peaks(self) -> dict[int, int]:
        """This rank's own peak at every size that fitted (the largest seen at each)."""
        peaks: dict[int, int] = {}
        for trials, _ in self.history:
            mine = trials[self.rank]
            peak = mine.peak_in(self.unit)
            if mine.fits and peak is not None:
                peaks[mine.batch_size] = max(peak, peaks.get(mine.batch_size, 0))
        return peaks

    def predicted(self, cap: int) -> int | None:
        """The largest size this rank's own peaks put under ``cap``, ``None`` with fewer than two sizes:
        a least-squares line through the `LINE_POINTS` largest (small sizes sit on a plateau of fixed
        memory, and near the boundary the line is what matters)."""
        every = self.peaks()
        if len(every) < 2:
            return None
        peaks = {size: every[size] for size in sorted(every)[-LINE_POINTS:]}
        n = len(peaks)
        mean_x, mean_y = sum(peaks) / n, sum(peaks.values()) / n
        spread = sum((x - mean_x) ** 2 for x in peaks)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in peaks.items()) / spread
        if slope <= 0:
            return None
        return math.floor((cap - (mean_y - slope * mean_x)) / slope)

    def next_size(self) -> int:
        step, ceiling = self.grid.multiple_of, self.grid.top if self.hi is None else self.hi - self.grid.multiple_of
        guess = None if self.missed else self.predicted(self.budget)
        if guess is None:
            guess = 2 * self.lo if self.hi is None else (self.lo + self.hi) // 2
        return self.grid.floor(min(ceiling, max(self.lo + step, guess)))

    def learn(self, size: int, trial: Trial) -> None:
        if trial.fits:
            self.lo = max(self.lo, size)
        elif self.rank in self.history[-1][1]:
            self.hi, self.missed = size, True
        # else: another rank ran out of memory first; this size is tried again next round

    def safe_candidate(self, cap: int, group_safe: int) -> int:
        """The largest size this rank's peaks put under ``cap``, within its max, not below the group's."""
        measured = [size for size, peak in self.peaks().items() if peak <= cap and size <= self.lo]
        predicted = self.predicted(cap)
        best = max([*measured, 0 if predicted is None else self.grid.floor(min(predicted, self.lo))])
        return max(group_safe, best)
