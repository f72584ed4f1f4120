"""batchfit as a gate: "does batch N still fit within X?" in tests and in CI.

[`check_fits`][batchfit.testing.gate.check_fits] answers with as few trials as the answer needs: one
real trial at N (through [`batchfit.Prober`][batchfit.Prober]); only when that runs out of memory, a
search below N (``find(max_batch=N - 1)``) to say which batch does fit, because "64 no longer fits"
is only actionable next to "48 still does". [`assert_fits`][batchfit.testing.gate.assert_fits] turns
a failure into an ``AssertionError`` for tests, and ``batchfit probe --require-batch N`` uses the
same [`check_fits`][batchfit.testing.gate.check_fits], so the CLI gate and a test cannot disagree.

The pytest plugin (the ``cuda`` marker, ``--require-cuda``) is ``batchfit.testing.pytest_plugin``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from batchfit.errors import NothingFitsError
from batchfit.probe.keywords import FindOptions
from batchfit.probe.options import options_from
from batchfit.probe.runner import TrialRequest, opened
from batchfit.report import DeviceInfo, Result, Trial, device_text
from batchfit.report.codec import Batch, Bytes, Count, Seconds, read_document, read_json
from batchfit.units import format_bytes

if TYPE_CHECKING:
    from typing_extensions import Unpack

GATE_SCHEMA = "batchfit.gate/1"


@dataclass(frozen=True)
class GateReport:
    """The answer of [`check_fits`][batchfit.testing.gate.check_fits].

    Attributes:
        batch_size: the batch that is required to fit.
        fits: it ran its steps without running out of memory within the budget.
        trial: the trial at ``batch_size``. When it failed, ``peak_bytes`` is the memory that
            was live plus the failing request: a lower bound of what that batch needs.
        budget_bytes: the memory limit the trial ran under.
        device: where it ran.
        largest_fit: only after a failure: the largest batch that fitted in the search below
            ``batch_size`` (0 when not even the smallest fitted, ``None`` when no search ran).
        search: the [`Result`][batchfit.Result] of that search, if one ran.
        elapsed_s: wall time of the whole check.
    """

    #: The schema its JSON document names (see `to_json`).
    SCHEMA: ClassVar[str] = GATE_SCHEMA

    batch_size: Batch
    fits: bool
    trial: Trial
    budget_bytes: Bytes | None
    device: DeviceInfo
    largest_fit: Count | None
    search: Result | None
    elapsed_s: Seconds

    @property
    def largest_trial(self) -> Trial | None:
        """The search trial at `largest_fit`, for its peak memory."""
        if self.search is None or not self.largest_fit:
            return None
        return self.search.trial(self.largest_fit)

    @property
    def device_text(self) -> str:
        return device_text(self.device)

    def explain(self) -> str:
        """One paragraph: the verdict, the measured peak against the limit, the largest fit."""
        trial = self.trial
        limit = format_bytes(self.budget_bytes)
        if self.fits:
            return (
                f"batch {self.batch_size} fits within {limit} on {self.device_text}: "
                f"peak {format_bytes(trial.capped_peak_bytes)}"
            )
        needed = (
            f"needing at least {format_bytes(trial.capped_peak_bytes)}"
            if trial.capped_peak_bytes is not None
            else "(peak unknown)"
        )
        where = f" in {trial.phase}" if trial.phase else ""
        text = (
            f"batch {self.batch_size} does not fit within {limit} on {self.device_text}: out of memory{where} {needed}"
        )
        largest = self.largest_trial
        if largest is not None:
            peak = format_bytes(largest.capped_peak_bytes)
            text += f"; the largest batch that fit is {self.largest_fit} (peak {peak})"
        elif self.largest_fit == 0:
            text += "; no smaller batch fits either"
        return text + "."

    # JSON -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": GATE_SCHEMA,
            "batch_size": self.batch_size,
            "fits": self.fits,
            "trial": asdict(self.trial),
            "budget_bytes": self.budget_bytes,
            "device": asdict(self.device),
            "largest_fit": self.largest_fit,
            "search": None if self.search is None else self.search.to_dict(),
            "elapsed_s": self.elapsed_s,
        }

    def to_json(self, indent: int | None = 2) -> str:
        import json

        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateReport:
        """The inverse of [`to_dict`][batchfit.report.result.Result.to_dict], read as
        [`batchfit.Result.from_dict`][batchfit.report.result.Result.from_dict] reads a result:
        every field checked against its type and what it can be (the trial, the device and the
        search's result with the same checks); one ``ValueError`` naming the field for anything
        else, e.g. ``not a batchfit gate report: field 'search.settings.headroom' must be a
        number in [0, 1), got float 1.5``."""
        return read_document(cls, data, "gate report")

    @classmethod
    def from_json(cls, text: str | bytes) -> GateReport:
        """The inverse of `to_json`; ``ValueError`` for anything else (see
        [`from_dict`][batchfit.testing.gate.GateReport.from_dict])."""
        return read_json(cls, text, "gate report")


def check_fits(
    model: Any,
    sample: Any = None,
    *,
    batch_size: int,
    callback: Callable[[Trial], None] | None = None,
    on_trial_start: Callable[[int, str], None] | None = None,
    on_start: Callable[[DeviceInfo, int | None], None] | None = None,
    **options: Unpack[FindOptions],
) -> GateReport:
    """Run the trials needed to say whether ``batch_size`` fits within ``memory_limit``.

    ``options`` are [`batchfit.find`][batchfit.find]'s
    ([`FindOptions`][batchfit.probe.keywords.FindOptions]: ``memory_limit``, ``optimizer``, ``loss_fn``,
    ``amp``, ``device``, ``reserve``, ...). Those that describe the work go to the trial at
    ``batch_size`` too; the search keywords only matter for the search below it. ``max_batch``
    is set by the gate (``batch_size - 1``), and ``verify_steps`` defaults to 0 there: the gate
    reports what fits, it does not pick a safe batch.
    """
    from batchfit.probe import Prober, find_with  # lazy: the gate's module loads no torch (the pytest plugin)

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if "max_batch" in options:
        raise TypeError("check_fits() got keyword(s) it cannot pass on: max_batch (the gate sets it to batch_size - 1)")
    settings = options_from("check_fits", options, FindOptions)
    started = time.monotonic()

    runner = Prober(model, sample, options=settings)
    with opened(runner) as setup:
        if on_start is not None:
            on_start(setup.device, setup.budget_bytes)
        if on_trial_start is not None:
            on_trial_start(batch_size, "gate")
        trial = runner.run(TrialRequest(batch_size, kind="gate", from_scratch=True))  # as a fresh training run meets it
        # reserve="auto": what lives outside the allocator grows after the warm-up (kernels load on
        # first launch), and a card of the limit's size holds it too: the verdict uses it.
        settled = runner.settle([trial])
        budget, device = settled.budget_bytes, setup.device
        peak = trial.peak_in(setup.counts)
        if trial.fits and budget is not None and peak is not None and peak > budget:
            phases = trial.phase_peaks_in(setup.counts)
            trial = replace(
                trial,
                fits=False,
                phase=max(phases, key=lambda item: item[1])[0] if phases else "step",
                message=(
                    f"the trial's peak of {format_bytes(peak)} is over the budget of {format_bytes(budget)} left once "
                    f"the reserve was measured again after the trial ({format_bytes(settled.reserve_bytes)} outside "
                    "the allocator)"
                ),
            )
        if callback is not None:
            callback(trial)

    search: Result | None = None
    largest: int | None = None
    smallest = settings.init_batch or settings.multiple_of
    if not trial.fits and batch_size - 1 >= smallest:
        below = replace(
            settings.untimed(),  # the gate reports the largest batch below; no throughput answer to time
            max_batch=batch_size - 1,
            verify_steps=settings.verify_steps if "verify_steps" in options else 0,
            noise_scale=False,
        )
        try:
            search = find_with(model, sample, below, callback=callback, on_trial_start=on_trial_start)
            largest = search.max_batch
        except NothingFitsError:
            largest = 0
    elif not trial.fits and batch_size == 1:
        largest = 0  # nothing is smaller than 1; with init_batch above N - 1 nothing was searched
    return GateReport(
        batch_size=batch_size,
        fits=trial.fits,
        trial=trial,
        budget_bytes=budget,
        device=device,
        largest_fit=largest,
        search=search,
        elapsed_s=time.monotonic() - started,
    )


def assert_fits(
    model: Any,
    sample: Any = None,
    *,
    batch_size: int,
    **find_kwargs: Any,
) -> GateReport:
    """Assert that ``model`` trains at ``batch_size`` within ``memory_limit``; `find_kwargs` are
    [`check_fits`][batchfit.testing.check_fits]'s (its hooks and [`FindOptions`][batchfit.probe.keywords.FindOptions]).

    Runs one real trial at ``batch_size``; only if it runs out of memory, a search below it.
    Raises ``AssertionError`` naming the measured peak, the limit and the largest batch that
    did fit. Returns the [`GateReport`][batchfit.testing.gate.GateReport] (its ``trial.peak_bytes`` is the measured
    peak).
    """
    report = check_fits(model, sample, batch_size=batch_size, **find_kwargs)
    if not report.fits:
        raise AssertionError(report.explain())
    return report
