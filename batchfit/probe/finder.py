"""The algorithm: search over real trials, pick and verify the safe batch, assemble the [`Result`][batchfit.Result].

`search_with` reads top to bottom as what a probe does: open the runner (the user's
objects snapshotted, the limit applied), let the pure search (``batchfit.search``) ask it for
trials until it knows the boundary, fit the memory equation, choose and verify the safe batch,
and hand back a frozen [`Result`][batchfit.Result] with the notes a reader needs; the
runner's ``close`` restores everything on the way out. It runs over any `Runner`
(``batchfit.probe.runner``) and never asks which: the real [`Prober`][batchfit.Prober], a job per
trial (``batchfit.probe.job_runner``) or fake trials (``batchfit.estimation``). The keyword front
end users call is [`batchfit.find`][batchfit.find].
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn

from batchfit.distributed import Solo
from batchfit.errors import NothingFitsError
from batchfit.probe.cache import open_cache
from batchfit.probe.checks import check_callbacks
from batchfit.probe.keywords import ProbeStartCallback, StartCallback, TrialCallback
from batchfit.probe.noise_measure import check_noise_data, measure_noise
from batchfit.probe.notes import allocator_notes, equation_notes, non_monotone, trial_notes
from batchfit.probe.options import Options
from batchfit.probe.positions import prompt_length
from batchfit.probe.prober import Prober
from batchfit.probe.probing import FromInit, SearchPlan
from batchfit.probe.runner import Findings, GroupAnswer, Runner, Settled, Setup, TrialRequest, opened
from batchfit.probe.safe_batch import boundary_room, safe_batch, safe_cap
from batchfit.probe.timing import (
    UNTIMED_STEPS,
    knee_deadline,
    step_at_max,
    throughput_notes,
    time_knee,
    time_safe,
    trial_cost,
    unpinned_notes,
    warm_steps,
)
from batchfit.report import Evaluation, Generation, MemoryModel, Result, Settings, Throughput, Trial, TrialKind, Unit
from batchfit.search import Attempt, SearchReport, confirm_from_scratch
from batchfit.version import __version__


def find_with(
    model: nn.Module,
    sample: Any,
    options: Options,
    *,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
) -> Result:
    """[`find`][batchfit.find] for callers that hold an [`Options`][batchfit.Options] (the CLI, the gate).

    With ``options.noise_scale`` the gradient noise scale is measured from ``sample``'s real
    batches after the probe, at its safe batch (``batchfit.probe.noise_measure``), into
    ``Result.noise_scale``; a sample that is not a source of batches is refused before any trial.
    With ``options.cache`` the answer is read from the cache directory when the same probe wrote
    it there, and written there after a probe (``batchfit.probe.cache``)."""
    started = time.monotonic()
    check_callbacks(callback, on_trial_start, on_start)
    if options.noise_scale:
        check_noise_data(sample)
    prober = Prober(model, sample, options=options)
    cache = open_cache(prober, options) if options.cache is not None else None
    hit = cache.look_up(started) if cache is not None else None
    if hit is not None:
        result = hit  # no trial ran, no callback was called
    else:
        result = search_with(
            prober, options, started, callback=callback, on_trial_start=on_trial_start, on_start=on_start
        )
        result = described(result, sample, options)
        if options.eval:  # the evaluation step, in what the training state leaves free: a probe of its own
            evaluated = find_with(
                model, sample, evaluation_options(options), callback=callback, on_trial_start=on_trial_start
            )
            notes = (*result.notes, *(f"eval: {note}" for note in evaluated.notes if note not in result.notes))
            elapsed = time.monotonic() - started  # both searches
            result = replace(result, evaluation=Evaluation.of(evaluated), notes=notes, elapsed_s=elapsed)
    if options.noise_scale:  # it depends on the weights, which the cache's key leaves out: measured every time
        noise = measure_noise(model, sample, options, micro_batch=result.safe_batch)
        result = replace(result, noise_scale=noise, elapsed_s=time.monotonic() - started)
    return result if cache is None or hit is not None else cache.store(result)


def evaluation_options(options: Options) -> Options:
    """``find(eval=True)``'s options for its evaluation probe: ``mode="eval"``, nothing added to the answer
    (the noise scale and the cache are the training answer's)."""
    return replace(options, mode="eval", eval=False, noise_scale=False, cache=None)


def described(result: Result, sample: Any, options: Options) -> Result:
    """``result`` with what its mode adds: a generation probe's `Generation` (the prompt, ``seq_len``
    when given, is read off the sample's token ids)."""
    if options.mode != "generate":
        return result
    assert options.max_new_tokens is not None
    prompt = options.seq_len if options.seq_len is not None else prompt_length(sample)
    generation = Generation.of(result.trials, result.memory, result.throughput, prompt, options.max_new_tokens)
    return replace(result, generation=generation)


def search_with(
    runner: Runner,
    options: Options,
    started: float,
    *,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
    plan: SearchPlan | None = None,
) -> Result:
    """The search, the safe batch and the [`Result`][batchfit.Result], over any runner.

    The sizes the throughput answer rests on are timed warm around the safe batch's verification
    (`batchfit.probe.timing`) where the runner's trials can (`Traits.times_warm`) and the options
    time steps warm (`warm_steps`). The steps that run trials call the pure search, the timing and
    `safe_batch` from here, with `SearchRun`'s methods: the path from `find` to the model stays short.

    Args:
        runner: what runs the trials (`batchfit.probe.runner.Runner`): the [`Prober`][batchfit.Prober],
            a job per trial (`batchfit.probe.job_runner`) or fake trials (`batchfit.estimation`).
        options: the probe's settings.
        started: the `time.monotonic()` the answer's time counts from.
        callback: told each trial once it ran.
        on_trial_start: told each trial's batch size and kind before it runs.
        on_start: told the device and the budget once the runner is open.
        plan: how the boundary is searched (`SearchPlan`); `None`: `FromInit`, from `init_batch`
            with the options' strategy. The frontier searches each further length from the boundary
            its surface predicts (`batchfit.probe.lengths`).
    """
    check_callbacks(callback, on_trial_start, on_start)
    plan = FromInit(options.make_strategy()) if plan is None else plan
    run = SearchRun(runner, options, started, callback, on_trial_start)
    grid, warm = run.grid, warm_steps(options)
    # 1. Open: the user's objects snapshotted, the model on the device, the limit applied (all
    #    undone by the runner's close, whatever ends the probe, Ctrl-C included).
    session = opened(runner, run.trials)
    try:
        with session as setup:
            run.open(setup)
            if on_start is not None:
                on_start(setup.device, run.budget)
            # 2. The boundary: the pure search asks for real trials until it knows it.
            try:
                report = plan.search(run.oracle, grid, should_stop=run.out_of_time, budget_bytes=run.budget)
            except NothingFitsError as failed:
                run.failed = None if run.in_trial else failed  # raised by the user's callback: not the verdict
                raise
            if setup.traits.layout_carries and run.trials[0].fits:
                # The optimizer kept between trials carries its memory layout (`batchfit.search.scratch`):
                # the boundary is confirmed as a fresh process meets it, on both sides.
                searched = report.largest_fit
                from_scratch = partial(run.oracle, from_scratch=True)
                report = confirm_from_scratch(report, grid, from_scratch, run.trials[0].batch_size)
                scratch_notes = run.say_from_scratch(searched, report.largest_fit)
            else:
                scratch_notes = []
            # 3. What lives outside the allocator may have grown since the set-up (kernels and
            #    handles load lazily): reserve="auto" measures it again, and the budget shrinks.
            #    4. The memory equation, fitted on the search's trials.
            run.settled = settled = runner.settle(run.trials)
            run.budget = budget = settled.budget_bytes
            memory = settled.memory if settled.memory is not None else plan.memory_hint(run.trials, budget, run.unit)
            run.notes += [*settled.notes, *scratch_notes]
            # 5. The knee's neighbourhood, timed warm and alike (a search trial's single step after a
            #    release runs cold, and must not be ranked against warm ones; `batchfit.probe.timing`).
            timing_notes: list[str] = []
            timing_s: float | None = None
            largest = report.largest_fit
            timing = run.timing and not run.out_of_time()
            if timing:
                timing_started = time.monotonic()
                timing_notes = time_knee(run.trials, largest, grid, run.timed, warm, run.neighbourhood(largest))
                timing_s = time.monotonic() - timing_started
            # 6. The safe batch the equation predicts, verified by real steps (the search's trials are
            #    its candidates): the last trial of a new size, so that it proves the safe batch in the
            #    state the rest left behind. When the throughput is timed, its warm steps are the safe
            #    batch's rate, the top of the curve (`SearchRun.verify_steps`).
            searched_trials = [t for t in run.trials if t.kind != "time"]
            if setup.traits.layout_carries:  # a caching allocator: the headroom holds one more of the largest block
                run.keep_free = boundary_room(searched_trials, report.largest_fit, report.smallest_fail)
            safe, verified, safe_notes = safe_batch(
                report, searched_trials, memory, budget, options, run.unit, run.run,
                keep_within=plan.keep_verified_within, steps=run.verify_steps, keep_free=run.keep_free,
            )  # fmt: skip
            if timing:  # the safe batch, unless its verification timed it; and where its rate moved the knee
                timing_started = time.monotonic()
                timing_notes += time_safe(run.trials, safe, run.timed, warm)
                timing_notes += unpinned_notes(run.trials, largest, safe, grid)
                timing_s = (timing_s or 0.0) + time.monotonic() - timing_started
            # 7. Ranks with different budgets: the runner finds each rank's own max and safe batch as it
            #    closes, where it can (`Findings.per_rank`; the Prober's `batchfit.probe.per_rank`).
            verify_steps, headroom = options.verify_steps, options.headroom
            session.answer = GroupAnswer(grid, largest, safe, verified, verify_steps, headroom, run.out_of_time)
    except NothingFitsError as failed:
        if failed is not run.failed:
            raise
        raise run.nothing_fits(failed, session.findings) from None
    # 8. The answer (after the runner's close, whose findings it carries).
    findings = session.findings
    assert findings is not None
    result = run.answer(report, memory, safe, verified, [*findings.notes, *safe_notes], timing_notes, timing_s)
    if not findings.per_rank:
        return result
    return replace(result, per_rank=findings.per_rank, notes=(*result.notes, *findings.per_rank_notes))


class SearchRun:
    """One probe's search over a runner: its trials, told to the callbacks as they run, and what
    `search_with`'s steps need of them. Each trial method calls `runner.run` itself, not through
    another: the path from `find` to the model stays short (`tests/test_call_path.py`)."""

    def __init__(
        self,
        runner: Runner,
        options: Options,
        started: float,
        callback: TrialCallback | None,
        on_trial_start: StartCallback | None,
    ) -> None:
        self.runner, self.options, self.started = runner, options, started
        self.callback, self.on_trial_start = callback, on_trial_start
        self.grid = options.grid()
        #: Every trial of the probe, in order.
        self.trials: list[Trial] = []
        #: What the runner said when it opened, and after the search (`open`, `runner.settle`); the
        #: budget and the memory it counts.
        self.setup: Setup | None = None
        self.settled: Settled | None = None
        self.budget: int | None = None
        self.unit: Unit = "allocated"
        #: The result's notes so far: the set-up's, the settling's, the search's own.
        self.notes: list[str] = []
        #: The search's `NothingFitsError`, once it gave up (told the fixed memory's advice after the close).
        self.failed: NothingFitsError | None = None
        #: True while a trial or a callback runs: a `NothingFitsError` raised then is not the search's verdict.
        self.in_trial = False
        #: What the safe batch's cap keeps free beyond the headroom, and why (`boundary_room`).
        self.keep_free: tuple[int, str | None] = (0, None)

    def open(self, setup: Setup) -> None:
        """Take what the runner said once it opened."""
        self.setup, self.budget, self.unit = setup, setup.budget_bytes, setup.counts
        self.notes = list(setup.notes)

    def run(self, batch_size: int, kind: TrialKind, steps: int | None = None, cap_bytes: int | None = None) -> Trial:
        """A trial of `kind` (`safe_batch`'s verifications), kept and told."""
        fresh = self._begin(batch_size, kind, steps)
        trial = self.runner.run(TrialRequest(batch_size, steps, kind, cap_bytes=cap_bytes, from_scratch=fresh))
        return self._keep(trial, cap_bytes)

    def timed(self, batch_size: int, warm: int) -> Trial:
        """A timing trial (`batchfit.probe.timing`): one untimed step, then ``warm`` timed ones."""
        steps = UNTIMED_STEPS + warm
        fresh = self._begin(batch_size, "time", steps)
        trial = self.runner.run(TrialRequest(batch_size, steps, "time", fresh_optimizer=fresh))
        return self._keep(trial, None)

    def oracle(self, batch_size: int, kind: TrialKind = "search", from_scratch: bool = False) -> Attempt:
        """A trial as the search sees it: its peaks in the unit the budget counts (reserved bytes on CUDA).

        Args:
            batch_size: the size to try.
            kind: `"verify"` runs the safe batch's verification, as `safe_batch` runs it (which then
                finds it done): a plan may aim its search with it.
            from_scratch: run as a fresh process runs it, no optimizer state kept.
        """
        steps, cap = (self.verify_steps, self.verify_cap(batch_size)) if kind == "verify" else (None, None)
        fresh = self._begin(batch_size, kind, steps, from_scratch)
        trial = self.runner.run(TrialRequest(batch_size, steps, kind, cap_bytes=cap, from_scratch=fresh))
        return verdict(self._keep(trial, cap), self.unit)

    def _begin(self, batch_size: int, kind: TrialKind, steps: int | None, from_scratch: bool = False) -> bool:
        """Say a trial starts; whether it runs from scratch. A verification runs as a real run's first
        steps do: from scratch (a fresh optimizer, whose state step 1 allocates; on a caching allocator a
        replay of a fresh process), or with a single step on the warm optimizer, so the state counts."""
        self.in_trial = True
        if self.on_trial_start is not None:
            self.on_trial_start(batch_size, kind)
        return from_scratch or (kind == "verify" and (steps or 0) >= 2)

    def _keep(self, trial: Trial, cap_bytes: int | None) -> Trial:
        """Keep a trial that ran (with the cap it ran under) and tell the callback."""
        if cap_bytes is not None:
            trial = replace(trial, cap_bytes=cap_bytes)
        self.trials.append(trial)
        if self.callback is not None:
            self.callback(trial)
        self.in_trial = False
        return trial

    def verify_cap(self, batch_size: int) -> int | None:
        """The cap a verification runs under: the budget less its headroom (none at `init_batch`)."""
        if self.budget is None or batch_size <= self.grid.init:
            return None
        return safe_cap(self.budget, self.options.headroom, self.keep_free[0])

    def out_of_time(self) -> bool:
        """Whether the time budget ran out; the first rank out of time stops them all, at the same point."""
        if self.options.time_budget is None:
            return False
        return self.ranks.any(time.monotonic() - self.started > self.options.time_budget)

    @property
    def ranks(self) -> Solo:
        """The ranks that probe together (`Setup.ranks`), once the runner is open."""
        return self.setup.ranks if self.setup is not None else Solo()

    @property
    def timing(self) -> bool:
        """Whether the throughput answer is timed warm: the options ask it (`warm_steps`), the runner's trials can."""
        return bool(warm_steps(self.options)) and self.setup is not None and self.setup.traits.times_warm

    @property
    def verify_steps(self) -> int:
        """The steps of the safe batch's verification: `verify_steps`, and when the throughput is
        timed at least `1 + warm_steps`, so that its warm steps are the safe batch's rate and it
        needs no trial of its own; under a meter that slows every step, `warm_steps` more, timed
        without it (`Prober.trial`). 0: no verification."""
        steps = self.options.verify_steps
        if not steps or not self.timing:
            return steps
        slows = self.setup is not None and self.setup.traits.slows_steps
        warm = warm_steps(self.options)
        return steps + warm if slows else max(steps, 1 + warm)

    def neighbourhood(self, largest: int) -> Callable[[int, int], bool]:
        """The `out_of_time(size, warm)` of the timing of the knee's neighbourhood, from now: whether
        that timing trial would end past `knee_deadline` (`trial_cost`), so the timing's cost stays bounded."""
        at_max = step_at_max(self.trials, largest)
        deadline = knee_deadline(time.monotonic(), at_max, self.started, self.options.time_budget)

        def out_of_time(size: int, warm: int) -> bool:
            ends = time.monotonic() + trial_cost(size, UNTIMED_STEPS + warm, largest, at_max)
            return bool(self.ranks.any(ends > deadline))

        return out_of_time

    def nothing_fits(self, failed: NothingFitsError, findings: Findings | None) -> NothingFitsError:
        """The search's `NothingFitsError`, told what the last trial said and the fixed memory's advice."""
        last, advice = self.trials[-1], findings.fixed_advice if findings is not None else None
        return NothingFitsError(failed.batch_size, failed.needed_bytes, self.budget, last.phase, last.message, advice)

    def say_from_scratch(self, searched: int, largest: int) -> list[str]:
        """A note when the boundary from scratch moved from the one the search found with the optimizer kept."""
        if largest < searched:
            return [
                f"batch {searched} fitted with the optimizer state kept from a smaller trial, not from scratch as "
                f"a fresh process runs it: the largest batch is {largest} "
                "(see docs/concepts/search.md#the-largest-batch-from-scratch)"
            ]
        if largest > searched:
            return [
                f"batch {searched + 1}"
                + (f" to {largest}" if largest > searched + 1 else "")
                + " failed with the optimizer state kept from a smaller trial but fitted from scratch, as a fresh "
                f"process runs it: the largest batch is {largest} "
                "(see docs/concepts/search.md#the-largest-batch-from-scratch)"
            ]
        return []

    def answer(
        self,
        report: SearchReport,
        memory: MemoryModel | None,
        safe: int,
        verified: bool,
        closing_notes: list[str],
        timing_notes: list[str],
        timing_s: float | None,
    ) -> Result:
        """The `Result`: what the trials measured, and what a reader should know about them (``closing_notes``:
        the runner's findings and the safe batch's, after the notes of the set-up and the search)."""
        trials, budget, unit, setup, settled = self.trials, self.budget, self.unit, self.setup, self.settled
        assert setup is not None and settled is not None
        throughput = Throughput.of(trials, timing_s=timing_s, largest=report.largest_fit)
        varies = setup.sized_on.leaf if setup.sized_on is not None else None  # real data of varying length
        limits = (settled.limit_bytes, settled.limit_source, settled.reserve_bytes)
        return Result(
            max_batch=report.largest_fit,
            safe_batch=safe,
            best_throughput_batch=throughput.best_batch if throughput else report.largest_fit,
            budget_bytes=budget,
            boundary_reached=report.boundary_reached,
            stop_reason=report.stop_reason,
            non_monotone=non_monotone(trials, report.largest_fit),
            safe_verified=verified,
            trials=tuple(trials),
            memory=memory,
            device=setup.device,
            settings=settings_of(self.options, *limits, report.strategy),
            elapsed_s=time.monotonic() - self.started,
            torch_version=torch.__version__,
            batchfit_version=__version__,
            notes=tuple(
                [
                    *self.notes,
                    *closing_notes,
                    *trial_notes(trials, report),
                    *allocator_notes(trials, report.largest_fit, budget, self.options.headroom, varies),
                    *equation_notes(memory, report, budget),
                    *timing_notes,
                    *throughput_notes(throughput),
                ]
            ),
            budget_counts=unit,
            throughput=throughput,
            world_size=setup.ranks.world_size,
            sized_on=setup.sized_on,
        )


def verdict(trial: Trial, unit: Unit) -> Attempt:
    """A trial as the search sees it: fits or not, and its peaks in the budget's unit."""
    return Attempt(trial.batch_size, trial.fits, trial.peak_in(unit), trial.phase_peaks_in(unit))


def settings_of(
    options: Options, limit_bytes: int | None, limit_source: str, reserve_bytes: int, strategy: str
) -> Settings:
    """The result's record of the settings: `Options.answer_settings`, the one projection the ranks
    agree on and the cache keys on, with the limit as resolved and the strategy the search ran."""
    answer = options.answer_settings()
    recorded = {name: answer[name] for name in Settings.__dataclass_fields__ if name in answer}
    return Settings(
        **{**recorded, "strategy": strategy},
        memory_limit_bytes=limit_bytes,
        limit_source=limit_source,
        time_budget_s=answer["time_budget"],
        reserve_bytes=reserve_bytes,
    )
