"""The algorithm: search over real trials, pick and verify the safe batch, assemble the :class:`Result`.

:func:`search_with` reads top to bottom as what a probe does: set the prober up (the user's
objects snapshotted, the limit applied), let the pure search (``batchfit.search``) ask it for
trials until it knows the boundary, fit the memory equation, choose and verify the safe batch,
and hand back a frozen :class:`~batchfit.report.Result` with the notes a reader needs; the
prober's ``__exit__`` restores everything on the way out. It runs over any prober: the real
:class:`~batchfit.probe.prober.Prober`, a job per trial (``batchfit.probe.jobs``) or fake
trials (``batchfit.estimation``). The keyword front end users call is :func:`batchfit.find`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from batchfit.errors import NothingFitsError
from batchfit.probe.cache import open_cache
from batchfit.probe.checks import check_callbacks
from batchfit.probe.noise import check_noise_data, measure_noise
from batchfit.probe.notes import equation_notes, non_monotone, ranks_notes, throughput_notes, trial_notes
from batchfit.probe.options import Options
from batchfit.probe.prober import Prober
from batchfit.probe.safe_batch import safe_batch, safe_cap
from batchfit.probe.timing import time_warm, timing_deadline
from batchfit.report import DeviceInfo, MemoryModel, Result, Settings, Throughput, Trial, TrialKind, Unit
from batchfit.search import Attempt, Grid, SearchReport, confirm_from_scratch, search
from batchfit.version import __version__

TrialCallback = Callable[[Trial], None]
StartCallback = Callable[[int, str], None]
ProbeStartCallback = Callable[[DeviceInfo, "int | None"], None]
#: ``(oracle, grid, should_stop, budget_bytes, verify) -> SearchReport``: a search other than the
#: default one; ``verify(b)`` runs the safe batch's verification at ``b`` (``None`` with ``verify_steps=0``).
Searcher = Callable[
    [Callable[[int], Attempt], Grid, Callable[[], bool], "int | None", "Callable[[int], Attempt] | None"],
    SearchReport,
]
#: ``(trials, budget_bytes, unit) -> MemoryModel | None``: the memory equation when the trials cannot fit one.
MemoryHint = Callable[[list[Trial], "int | None", Unit], "MemoryModel | None"]


def find_with(
    model: nn.Module,
    sample: Any,
    options: Options,
    *,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
) -> Result:
    """:func:`find` for callers that hold an :class:`~batchfit.probe.options.Options` (the CLI, the gate).

    With ``options.noise_scale`` the gradient noise scale is measured from ``sample``'s real
    batches after the probe, at its safe batch (``batchfit.probe.noise``), into
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
    if options.noise_scale:  # it depends on the weights, which the cache's key leaves out: measured every time
        noise = measure_noise(model, sample, options, micro_batch=result.safe_batch)
        result = replace(result, noise_scale=noise, elapsed_s=time.monotonic() - started)
    return result if cache is None or hit is not None else cache.store(result)


def search_with(
    prober: Any,
    options: Options,
    started: float,
    *,
    callback: TrialCallback | None = None,
    on_trial_start: StartCallback | None = None,
    on_start: ProbeStartCallback | None = None,
    searcher: Searcher | None = None,
    memory_hint: MemoryHint | None = None,
    keep_verified_within: float = 0.0,
) -> Result:
    """The search, the safe batch and the :class:`Result`, over any ``prober`` that does what
    :class:`Prober` does (a context manager with ``trial()``, ``budget_bytes``, ``counts``,
    ``device_info``, ``notes``, ``ranks``, ``memory_model()``, ``fixed_advice()``,
    ``ranks_notes()``, ``compile_notes()``, ``meter_notes()``, ``settle_reserve()``, ``layout_carries``
    and the limit's ``limit_bytes`` /
    ``limit_source`` / ``reserve_bytes``):
    :class:`Prober` here, a job per trial in ``batchfit.probe.jobs``. ``started``: the
    ``time.monotonic()`` the answer's time counts from.

    ``searcher`` replaces the search from ``init_batch`` (:func:`batchfit.search.search` with the
    options' strategy): the frontier searches each further length from the boundary its surface
    predicts (``batchfit.probe.frontier``), and may run the safe batch's verification first, at
    the safe batch it predicts, as the search's first measured point; ``keep_verified_within``
    (a fraction) keeps such a verification as the safe batch when the memory line's candidate is
    at most that much above it (see :func:`~batchfit.probe.safe_batch.safe_batch`).
    ``memory_hint`` gives the memory equation when the trials measured fewer than two fitting
    sizes (such a search can end after one fit and one failure), so that the safe batch is still
    aimed by memory and not set to ``init_batch``. The sizes the throughput answer rests on are
    timed warm after the search (``batchfit.probe.timing``) where the prober's trials can
    (``prober.times_warm``) and ``options.timed_steps`` is not 0."""
    check_callbacks(callback, on_trial_start, on_start)
    grid, chooser = options.grid(), options.make_strategy()
    trials: list[Trial] = []

    def run(
        batch_size: int,
        kind: TrialKind,
        steps: int | None = None,
        cap_bytes: int | None = None,
        from_scratch: bool = False,
    ) -> Trial:
        if on_trial_start is not None:
            on_trial_start(batch_size, kind)
        # The verification runs as the first steps of a real run do: a fresh optimizer whose
        # state step 1 allocates (with a single step it keeps the warm one, so the state counts).
        fresh = from_scratch or (kind == "verify" and (steps or 0) >= 2)
        trial = prober.trial(batch_size, steps=steps, kind=kind, fresh_optimizer=fresh, cap_bytes=cap_bytes)
        if cap_bytes is not None:
            trial = replace(trial, cap_bytes=cap_bytes)
        trials.append(trial)
        if callback is not None:
            callback(trial)
        return trial

    def out_of_time() -> bool:
        # Every rank must stop at the same point: the first rank out of time stops them all.
        late = options.time_budget is not None and time.monotonic() - started > options.time_budget
        return prober.ranks.any(late) if options.time_budget is not None else False

    in_trial = [False]  # an exception raised while True came from a trial or a callback, not the search

    def verify(batch_size: int) -> Attempt:
        # The safe batch's verification, run by a searcher that aims with it (see ``searcher``):
        # as safe_batch() runs it, so that safe_batch() finds it done and does not run it again.
        cap = safe_cap(budget, options.headroom) if budget is not None and batch_size > grid.init else None
        in_trial[0] = True
        trial = run(batch_size, "verify", options.verify_steps, cap)
        in_trial[0] = False
        return verdict(trial, unit)

    def oracle(batch_size: int) -> Attempt:
        in_trial[0] = True
        trial = run(batch_size, "search")
        in_trial[0] = False
        # The search sees each trial in the unit the budget counts (reserved bytes on CUDA).
        return verdict(trial, unit)

    # 1. Set up: the user's objects snapshotted, the model on the device, the limit applied (all
    #    undone by the prober's __exit__, whatever ends the probe, Ctrl-C included).
    with prober:
        budget, unit = prober.budget_bytes, prober.counts
        if on_start is not None:
            on_start(prober.device_info, budget)
        # 2. The boundary: the pure search asks for real trials until it knows it.
        try:
            if searcher is None:
                report = search(oracle, grid, chooser, out_of_time, budget_bytes=budget)
            else:
                report = searcher(oracle, grid, out_of_time, budget, verify if options.verify_steps else None)
        except NothingFitsError as failed:
            if in_trial[0]:
                raise  # the user's callback (or model) raised it: not the search's verdict
            last = trials[-1]
            raise NothingFitsError(
                failed.batch_size, failed.needed_bytes, budget, last.phase, last.message, prober.fixed_advice()
            ) from None
        if prober.layout_carries and trials[0].fits:
            # The optimizer kept between trials carries its memory layout (``batchfit.search.scratch``):
            # the largest fit is tried again as a fresh process runs it (the first trial did).
            searched = report.largest_fit
            report = confirm_from_scratch(
                report, grid, lambda b: verdict(run(b, "search", from_scratch=True), unit), trials[0].batch_size
            )
            if report.largest_fit < searched:
                prober.notes.append(
                    f"batch {searched} fitted with the optimizer state kept from an earlier, smaller trial, but not "
                    f"from scratch as a fresh process runs it (the allocator carves the state out of the first "
                    f"step's activation segments): the largest batch is {report.largest_fit}, found from scratch"
                )
        # 3. What lives outside the allocator may have grown since the set-up (kernels and
        #    handles load lazily): reserve="auto" measures it again, and the budget shrinks.
        budget = prober.settle_reserve()
        # 4. The memory equation, fitted on the search's trials.
        memory = prober.memory_model(trials)
        if memory is None and memory_hint is not None:
            memory = memory_hint(trials, budget, unit)
        # 5. The sizes the throughput answer rests on, timed warm and alike (a search trial's
        #    single step after a release runs cold, and must not be ranked against warm ones);
        #    before the safe batch's verification, so that what timing leaves behind (kernels and
        #    caches for new shapes, a fragmented heap) is in the state the verification proves.
        timing_notes: list[str] = []
        timing_s: float | None = None
        timing = bool(options.timed_steps) and getattr(prober, "times_warm", False) and not out_of_time()

        def timed(b: int) -> Trial:
            return run(b, "time", 1 + options.timed_steps)

        if timing:
            timing_started = time.monotonic()

            def start_neighbourhood() -> Callable[[], bool]:
                deadline = timing_deadline(time.monotonic(), started, options.time_budget)
                return lambda: bool(prober.ranks.any(time.monotonic() > deadline))

            timing_notes = time_warm(
                trials, [report.largest_fit], grid, timed, options.timed_steps, start_neighbourhood
            )
            timing_s = time.monotonic() - timing_started
        # 6. The safe batch the equation predicts, verified by real steps (the search's trials are
        #    its candidates; the sizes just timed are not).
        searched = [t for t in trials if t.kind != "time"]
        safe, verified, safe_notes = safe_batch(
            report, searched, memory, budget, options, unit, run, keep_within=keep_verified_within
        )
        if timing:  # the safe batch alike, unless its verification timed as many warm steps
            timing_started = time.monotonic()
            timing_notes += time_warm(trials, [safe], grid, timed, options.timed_steps)
            timing_s = (timing_s or 0.0) + time.monotonic() - timing_started
    # 7. The answer: what the trials measured, and what a reader should know about them.
    throughput = Throughput.of(trials, timing_s=timing_s, largest=report.largest_fit)

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
        device=prober.device_info,
        settings=_settings(options, prober, report.strategy),
        elapsed_s=time.monotonic() - started,
        torch_version=torch.__version__,
        batchfit_version=__version__,
        notes=tuple(
            [
                *prober.notes,
                *prober.compile_notes(trials),
                *prober.meter_notes(),
                *ranks_notes(prober),
                *safe_notes,
                *trial_notes(trials, report),
                *equation_notes(memory, report, budget),
                *timing_notes,
                *throughput_notes(throughput),
            ]
        ),
        budget_counts=unit,
        throughput=throughput,
        world_size=prober.ranks.world_size,
        sized_on=getattr(prober, "sized_on", None),
    )


def verdict(trial: Trial, unit: Unit) -> Attempt:
    """A trial as the search sees it: fits or not, and its peaks in the budget's unit."""
    return Attempt(trial.batch_size, trial.fits, trial.peak_in(unit), trial.phase_peaks_in(unit))


def _settings(options: Options, prober: Prober, strategy: str) -> Settings:
    return settings_of(options, prober.limit_bytes, prober.limit_source, prober.reserve_bytes, strategy)


def settings_of(
    options: Options, limit_bytes: int | None, limit_source: str, reserve_bytes: int, strategy: str
) -> Settings:
    grid = options.grid()
    return Settings(
        mode=options.mode,
        amp=options.amp,
        init_batch=grid.init,
        max_batch=grid.maximum,
        multiple_of=grid.multiple_of,
        steps_per_trial=options.steps_per_trial,
        verify_steps=options.verify_steps,
        headroom=float(options.headroom),
        strategy=strategy,
        memory_limit_bytes=limit_bytes,
        limit_source=limit_source,
        time_budget_s=None if options.time_budget is None else float(options.time_budget),
        reserve_bytes=reserve_bytes,
    )
