"""The gradient noise scale: the record, and the pure two-batch-size estimator behind it.

Pure Python (no torch): the measurement (``batchfit.probe.noise_measure``) hands over plain squared
norms, and everything statistical happens here, where it can be tested exhaustively.

The estimator is McCandlish et al. 2018 (arXiv 1812.06162), appendix A. A *window* is ``K``
gradients of micro-batches of ``b`` samples: ``small`` is the mean of their squared norms
``|g_b|^2``, ``big`` the squared norm of their mean, the gradient of a batch of ``B = K b``.
Since ``E|g_b|^2 = |G|^2 + tr(Sigma) / b`` for every batch size ``b``, each window gives the
unbiased estimates

    |G|^2     = (B big - b small) / (B - b)
    tr(Sigma) = (small - big) / (1/b - 1/B)

(``small >= big`` always, so ``tr(Sigma)`` is never negative; ``|G|^2`` may come out negative
where the noise drowns the signal). Both are averaged over the windows *separately*, then divided:
``B_simple = tr(Sigma) / |G|^2`` (a ratio of means, not a mean of ratios, which a window with a
tiny ``|G|^2`` would blow up). The interval resamples whole windows with replacement (a seeded
bootstrap of that ratio); a resample whose ``|G|^2`` is not above zero counts as an unbounded noise
scale, so an interval that reaches one has no upper end (``high`` is ``None``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from batchfit.report.codec import Batch, Count, JsonRecord, Range, Seconds

#: Where the small and the big batch came from: K micro-batches on one process and their mean,
#: or each rank's local gradient and the all-reduced mean under DDP.
NoiseSource = Literal["micro-batches", "ranks"]

#: Bootstrap resamples of the windows behind the interval.
RESAMPLES = 2000
#: Fewer windows than this make a rough interval, and a note says so.
FEW_WINDOWS = 8


@dataclass(frozen=True)
class NoiseEstimate:
    """What [`estimate`][batchfit.estimate] makes of the windows: the plain numbers a
    [`NoiseScale`][batchfit.report.noise.NoiseScale] holds."""

    b_simple: float | None
    low: float
    high: float | None
    gradient_sq: float
    trace_sigma: float
    small_norm_sq: float
    big_norm_sq: float
    notes: tuple[str, ...]


def window_estimates(small: float, big: float, small_batch: int, big_batch: int) -> tuple[float, float]:
    """``(|G|^2, tr(Sigma))`` of one window (see the module docs): ``small`` the mean squared norm
    of its ``small_batch`` gradients, ``big`` the squared norm of their mean (``big_batch``)."""
    b, B = float(small_batch), float(big_batch)
    return (B * big - b * small) / (B - b), (small - big) / (1.0 / b - 1.0 / B)


def estimate(
    windows: Sequence[tuple[float, float]],
    small_batch: int,
    big_batch: int,
    *,
    confidence: float = 0.9,
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> NoiseEstimate:
    """``B_simple`` and its bootstrap interval from ``(small, big)`` squared norms per window.

    ``ValueError`` for fewer than two windows, batch sizes that are not ``1 <= b < B``, a
    confidence outside ``(0, 1)``, and norms that are negative or not finite."""
    check_estimator_inputs(windows, small_batch, big_batch, confidence)
    per_window = [window_estimates(small, big, small_batch, big_batch) for small, big in windows]
    n = len(per_window)
    gradient_sq = math.fsum(g for g, _ in per_window) / n
    trace_sigma = math.fsum(t for _, t in per_window) / n
    b_simple = trace_sigma / gradient_sq if gradient_sq > 0 else None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        drawn = rng.choices(per_window, k=n)
        g = math.fsum(x for x, _ in drawn)
        t = math.fsum(y for _, y in drawn)
        ratios.append(t / g if g > 0 else math.inf)
    ratios.sort()
    tail = (1.0 - confidence) / 2.0
    low = ratios[max(0, math.floor(tail * resamples))]
    high = ratios[min(resamples - 1, math.ceil((1.0 - tail) * resamples) - 1)] if b_simple is not None else math.inf
    notes = []
    unbounded = sum(1 for r in ratios if math.isinf(r)) / resamples
    if b_simple is None:
        notes.append(
            f"the signal |G|^2 did not show above the noise (measured {gradient_sq:.3g}): the noise scale is larger "
            f"than batches of {big_batch} resolve"
            + ("" if math.isinf(low) else f", at least ~{_number(low)}")
            + "; more passes or a larger micro batch narrow it"
        )
    elif high == math.inf:
        notes.append(
            f"the interval has no upper end: in {unbounded:.0%} of the resampled windows the signal |G|^2 did not show "
            "above the noise; more passes narrow it"
        )
    if math.isinf(low):
        notes.append(f"no lower bound was measured at {confidence:.0%}: low is 0")
        low = 0.0
    if n < FEW_WINDOWS:
        notes.append(f"only {n} windows: the interval is rough")
    return NoiseEstimate(
        b_simple=b_simple,
        low=low,
        high=None if math.isinf(high) else high,
        gradient_sq=gradient_sq,
        trace_sigma=trace_sigma,
        small_norm_sq=math.fsum(s for s, _ in windows) / n,
        big_norm_sq=math.fsum(b for _, b in windows) / n,
        notes=tuple(notes),
    )


def check_estimator_inputs(
    windows: Sequence[tuple[float, float]], small_batch: int, big_batch: int, confidence: float
) -> None:
    """The estimator's preconditions, each named in a ``ValueError``."""
    if len(windows) < 2:
        raise ValueError(f"the noise scale needs at least 2 windows to estimate and resample, got {len(windows)}")
    if not 1 <= small_batch < big_batch:
        raise ValueError(f"the batch sizes must be 1 <= small < big, got {small_batch} and {big_batch}")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise ValueError(f"confidence must be a fraction in (0, 1), got {confidence!r}")
    for index, (small, big) in enumerate(windows):
        if not (math.isfinite(small) and math.isfinite(big)) or small < 0 or big < 0:
            raise ValueError(
                f"window {index}: squared gradient norms must be finite and not negative, got {small!r} and {big!r} "
                "(inf or NaN gradients: check the loss, or the fp16 loss scale)"
            )


def _number(value: float) -> str:
    """A noise scale as the summary shows it: whole samples from 10 up, two digits below."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def _interval(low: float, high: float, grouped: bool = True) -> str:
    """``low-high`` with both ends to the precision the smaller one needs (``0.89-1.00``, ``1.5-12.0``,
    ``150-240``): an end printed as ``1`` beside ``0.89`` reads as less precise than it is."""
    smallest = min((value for value in (low, high) if value > 0), default=0.0)
    places = 0 if smallest == 0 or smallest >= 10 else max(0, 1 - math.floor(math.log10(smallest)))
    comma = "," if grouped else ""
    return f"{low:{comma}.{places}f}-{high:{comma}.{places}f}"


@dataclass(frozen=True)
class NoiseScale(JsonRecord):
    """The simple gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018),
    measured from real batches with the unbiased two-batch-size estimator.

    Attributes:
        b_simple: the estimate, in samples; ``None`` when the measured signal ``|G|^2`` was not
            above zero (the noise drowned it: the true value is large, see ``low``).
        low, high: the bootstrap interval over windows (``confidence``); ``high`` is ``None``
            when the interval reaches a non-positive ``|G|^2`` (no upper bound measured).
        gradient_sq: the estimate of ``|G|^2``, the squared norm of the true gradient.
        trace_sigma: the estimate of ``tr(Sigma)``, the per-sample gradient variance summed.
        small_batch, big_batch: the two batch sizes (``b`` and ``K x b``).
        windows: how many big batches were measured (each of ``big_batch // small_batch``
            small ones); the interval resamples them.
        passes: forward/backward passes run (on each rank).
        samples: samples seen (on all ranks).
        elapsed_s: the measurement's wall time.
        source: ``"micro-batches"`` or ``"ranks"`` (DDP: a rank's local gradient is the small
            batch, the all-reduced one the big).
        world_size: the ranks that measured together.
        notes: what a reader should know (wide interval, batches dropped, ...).
        small_norm_sq, big_norm_sq: the mean squared gradient norms measured at ``small_batch``
            and ``big_batch`` (``None`` when not recorded); ``small_norm_sq`` alone overstates
            ``|G|^2`` by ``tr(Sigma) / small_batch``, which is what the estimator takes out.

    JSON both ways: ``NoiseScale.from_json(noise.to_json()) == noise`` (`batchfit.report.codec.JsonRecord`).
    """

    NOUN: ClassVar[str] = "noise scale"

    b_simple: Annotated[float, Range(0)] | None
    low: Annotated[float, Range(0)]
    high: Annotated[float, Range(0)] | None
    gradient_sq: float
    trace_sigma: float
    small_batch: Batch
    big_batch: Batch
    windows: Batch
    passes: Count
    samples: Count
    elapsed_s: Seconds
    confidence: Annotated[float, Range(0, 1)] = 0.9
    source: NoiseSource = "micro-batches"
    world_size: Batch = 1
    notes: tuple[str, ...] = ()
    small_norm_sq: Annotated[float, Range(0)] | None = None
    big_norm_sq: Annotated[float, Range(0)] | None = None

    @classmethod
    def from_windows(
        cls,
        windows: Sequence[tuple[float, float]],
        small_batch: int,
        big_batch: int,
        *,
        passes: int,
        samples: int,
        elapsed_s: float,
        confidence: float = 0.9,
        seed: int = 0,
        source: NoiseSource = "micro-batches",
        world_size: int = 1,
        notes: Sequence[str] = (),
    ) -> NoiseScale:
        """The record of a measurement: [`estimate`][batchfit.estimate] over ``(small, big)`` squared norms per
        window, with what the measurement cost and its own ``notes`` (the estimator's follow)."""
        found = estimate(windows, small_batch, big_batch, confidence=confidence, seed=seed)
        return cls(
            b_simple=found.b_simple,
            low=found.low,
            high=found.high,
            gradient_sq=found.gradient_sq,
            trace_sigma=found.trace_sigma,
            small_batch=small_batch,
            big_batch=big_batch,
            windows=len(windows),
            passes=passes,
            samples=samples,
            elapsed_s=elapsed_s,
            confidence=float(confidence),
            source=source,
            world_size=world_size,
            notes=(*notes, *found.notes),
            small_norm_sq=found.small_norm_sq,
            big_norm_sq=found.big_norm_sq,
        )

    @staticmethod
    def plain(value: float) -> str:
        """A noise-scale number as the recommendation and the CLI write it: whole samples from 10 up
        (written plain, as batch sizes are), two digits below."""
        return f"{value:.0f}" if value >= 10 else f"{value:.2g}"

    def interval_text(self) -> str:
        """``90% 150-240``, or ``90% at least 150, no upper bound``."""
        if self.high is None:
            return f"{self.confidence:.0%} at least {self.plain(self.low)}, no upper bound"
        return f"{self.confidence:.0%} {_interval(self.low, self.high, grouped=False)}"

    def summary(self) -> str:
        """One line: ``B_simple ~190 samples (90% interval 150-240; 128 passes of batch 16 in 12.3 s)``."""
        share = f"{self.confidence:.0%}"
        interval = f"{_number(self.low)}-unbounded" if self.high is None else _interval(self.low, self.high)
        if self.b_simple is None:
            value = f"B_simple large (the signal drowned in its noise; {share} interval {interval}"
        else:
            value = f"B_simple ~{_number(self.b_simple)} samples ({share} interval {interval}"
        ranks = f" on each of {self.world_size} ranks" if self.world_size > 1 else ""
        return f"{value}; {self.passes} passes of batch {self.small_batch}{ranks} in {self.elapsed_s:.1f} s)"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NoiseScale:
        """The inverse of ``dataclasses.asdict(noise)`` (and of ``to_dict``); ``ValueError`` naming the field
        otherwise."""
        return super().from_dict(data)
