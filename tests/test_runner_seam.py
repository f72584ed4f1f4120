"""A fifth way to run trials is one class with the runner seam's four methods (issue 49, item 1).

`LineRunner` below is written against `batchfit.probe.runner` alone: its "memory" is a line,
``fixed + per_sample x batch``, against a budget. It goes through `search_with`, the one search
every runner takes, unchanged, and gets the search's contract (`tests/test_find.py`,
`tests/test_call_path.py`): the largest batch that fits exactly, a verified safe batch within it
under the headroom, the search's trial counts, the callbacks told every trial in order, and the
close called once however the probe ends. Nothing above the seam asks which runner it holds: the
ranks, the notes and each rank's own answer come back through `Setup` and `Findings`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import pytest

import batchfit
from batchfit.distributed import Solo
from batchfit.probe import Options
from batchfit.probe.finder import search_with
from batchfit.probe.runner import Findings, GroupAnswer, Runner, Settled, Setup, Traits, TrialRequest, opened
from batchfit.report import DeviceInfo, MemoryModel, PhaseLine, RankBatch, Trial

MiB = 2**20


class LineRunner:
    """Trials whose peak is ``fixed + per_sample x batch``; a trial fits where that is within its cap."""

    def __init__(self, fixed: int, per_sample: int, budget: int, *, world_size: int = 1, fail_at: int | None = None):
        self.fixed, self.per_sample, self.budget = fixed, per_sample, budget
        self.ranks = Solo(world_size)
        self.fail_at = fail_at  # a size whose trial raises a non-memory error
        self.requests: list[TrialRequest] = []
        self.closed: list[tuple[int, GroupAnswer | None, BaseException | None]] = []

    def open(self) -> Setup:
        device = DeviceInfo(type="line", name="a line", total_bytes=self.budget)
        limits = (self.budget, "memory_limit", 0)
        return Setup(self.budget, "allocated", device, self.ranks, *limits, Traits(), None, ("a line",))

    def run(self, request: TrialRequest) -> Trial:
        self.requests.append(request)
        if request.batch_size == self.fail_at:
            raise RuntimeError("the line broke")
        peak = self.fixed + self.per_sample * request.batch_size
        fits = peak <= (request.cap_bytes or self.budget)
        return Trial(
            batch_size=request.batch_size,
            fits=fits,
            kind=request.kind,
            phase=None if fits else "forward",
            peak_bytes=peak,
            phase_peaks=(("forward", peak),),
            steps=request.steps or 1,
            message=None if fits else "out of memory (a line)",
        )

    def settle(self, trials: Sequence[Trial]) -> Settled:
        line = PhaseLine("forward", self.fixed, self.per_sample)
        memory = MemoryModel(self.fixed, self.per_sample, "forward", (line,))
        return Settled(self.budget, self.budget, "memory_limit", 0, memory, ("settled",))

    def close(self, trials: Sequence[Trial], answer: GroupAnswer | None, exc: BaseException | None) -> Findings:
        self.closed.append((len(trials), answer, exc))
        if exc is not None:
            return Findings(fixed_advice="the line's fixed bytes alone fill the budget")
        per_rank = ()
        if answer is not None and self.ranks.world_size > 1:
            per_rank = tuple(
                RankBatch(rank=r, max_batch=answer.largest, safe_batch=answer.safe, budget_bytes=self.budget,
                          safe_verified=answer.verified, boundary_reached=True)
                for r in range(self.ranks.world_size)
            )  # fmt: skip
        return Findings(("closed",), None, per_rank, ("each rank's own answer",) if per_rank else ())


def largest_within(runner: LineRunner, budget: float) -> int:
    return math.floor((budget - runner.fixed) / runner.per_sample)


@pytest.mark.parametrize("strategy", ["interpolate", "binary"])
def test_a_runner_written_against_the_seam_gets_the_searchs_contract(strategy: str) -> None:
    runner = LineRunner(fixed=3 * MiB, per_sample=37_000, budget=16 * MiB)
    assert isinstance(runner, Runner)
    options = Options(memory_limit=16 * MiB, strategy=strategy, max_batch=4096)
    started, finished, told = [], [], []
    result = search_with(
        runner,
        options,
        time.monotonic(),
        callback=finished.append,
        on_trial_start=lambda size, kind: started.append((size, kind)),
        on_start=lambda device, budget: told.append((device.type, budget)),
    )
    truth = largest_within(runner, runner.budget)
    assert result.max_batch == truth and result.boundary_reached and result.stop_reason == "boundary"
    assert result.trial(truth).fits and not result.trial(truth + 1).fits
    assert len(result.search_trials) <= 2 * (options.max_batch - 1).bit_length() + 2
    assert result.safe_verified and result.safe_batch <= result.max_batch
    assert result.safe_batch <= largest_within(runner, (1 - options.headroom) * runner.budget)
    verification = [t for t in result.trials if t.kind == "verify"][-1]
    assert verification.batch_size == result.safe_batch and verification.cap_bytes is not None
    assert not any(t.kind == "time" for t in result.trials)  # Traits(): the runner cannot time warm
    assert told == [("line", runner.budget)]
    assert tuple(finished) == result.trials
    assert started == [(t.batch_size, t.kind) for t in result.trials]
    assert [r.batch_size for r in runner.requests] == [t.batch_size for t in result.trials]
    assert result.device.type == "line" and result.world_size == 1 and result.per_rank == ()
    assert result.notes[:3] == ("a line", "settled", "closed")
    (count, answer, exc), = runner.closed
    assert count == len(result.trials) and exc is None
    assert answer is not None and (answer.largest, answer.safe) == (result.max_batch, result.safe_batch)


def test_the_ranks_and_each_ranks_answer_come_back_through_the_seam() -> None:
    runner = LineRunner(fixed=3 * MiB, per_sample=37_000, budget=16 * MiB, world_size=2)
    result = search_with(runner, Options(memory_limit=16 * MiB), time.monotonic())
    assert result.world_size == 2
    assert [r.rank for r in result.per_rank] == [0, 1] and result.notes[-1] == "each rank's own answer"


def test_nothing_fits_is_told_the_runners_advice_after_its_close() -> None:
    runner = LineRunner(fixed=17 * MiB, per_sample=37_000, budget=16 * MiB)
    with pytest.raises(batchfit.NothingFitsError, match="fixed bytes alone fill the budget") as info:
        search_with(runner, Options(memory_limit=16 * MiB), time.monotonic())
    assert info.value.budget_bytes == 16 * MiB
    ((_, answer, exc),) = runner.closed
    assert answer is None and isinstance(exc, batchfit.NothingFitsError)


def test_an_error_in_a_trial_is_never_swallowed_and_the_runner_is_closed_with_it() -> None:
    runner = LineRunner(fixed=3 * MiB, per_sample=37_000, budget=16 * MiB, fail_at=2)
    with pytest.raises(RuntimeError, match="the line broke"):
        search_with(runner, Options(memory_limit=16 * MiB), time.monotonic())
    ((_, _, exc),) = runner.closed
    assert isinstance(exc, RuntimeError)


def test_opened_closes_a_runner_however_the_block_ends() -> None:
    runner = LineRunner(fixed=3 * MiB, per_sample=37_000, budget=16 * MiB)
    session = opened(runner)
    with pytest.raises(KeyboardInterrupt), session as setup:
        assert setup.budget_bytes == 16 * MiB
        runner.run(TrialRequest(4))
        raise KeyboardInterrupt
    assert session.findings is not None and session.findings.fixed_advice is not None
    assert isinstance(runner.closed[0][2], KeyboardInterrupt)
