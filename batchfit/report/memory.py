"""The memory equation: per-phase lines fitted to the trials' peaks (see [`MemoryModel`][batchfit.MemoryModel])."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated

from batchfit.report.codec import INT_LIMIT, Bytes, Range
from batchfit.report.records import PhaseName, Trial, Unit

#: A fitted line's bytes, or bytes a sample: either sign (least squares can give a negative
#: intercept, a flat phase a slope just below 0), but within what any memory holds, so a
#: prediction from a document stays a finite number.
FittedBytes = Annotated[float, Range(-INT_LIMIT, INT_LIMIT)]


@dataclass(frozen=True)
class PhaseLine:
    """``peak(b) = fixed_bytes + per_sample_bytes * b`` for one phase of the step."""

    phase: PhaseName
    fixed_bytes: FittedBytes
    per_sample_bytes: FittedBytes

    def predict(self, batch_size: float) -> float:
        return self.fixed_bytes + self.per_sample_bytes * batch_size


@dataclass(frozen=True)
class MemoryModel:
    """The fitted memory equation of a training (or inference) step.

    The peak of a step is not always in the same phase: at small batches the optimizer step
    (weights + grads + optimizer moments + temporaries) can be the peak and stays flat, until
    the activations of forward/backward overtake it. Within a phase, too, the peak can move
    from one tensor to another as the batch grows, so a phase's peak bends upwards (a flat
    start, then kinks: it is the maximum of lines, one per moment of the phase). So the lines
    are fitted per phase, and the prediction is their maximum:

    * each phase's line is fitted (least squares) over its *upper piece*: the longest run of
      its largest fitting sizes that one growing line fits, every peak within 0.2% of it (or
      within the allocator's granularity, the greatest common divisor of the peaks, when that
      is coarser: CUDA reserves whole 2 MiB segments). A flat start and the sizes below a kink
      fall outside; a phase with no growing run gets the line through all its sizes;
    * below its upper piece, a phase also keeps the chord between each two neighbouring
      measured sizes, as long as the chord does not fall and stays within the measured peaks
      (it does wherever the phase bends upwards). Between two measured sizes such a chord lies
      above the true peak, so predictions below the upper piece err on the safe side, where the
      upper line extended down would promise more than fits.

    ``fixed_bytes``, ``per_sample_bytes`` and ``phase`` are the line of the phase that decides
    the boundary: the phase whose line predicts the highest peak at the largest fitting size
    (the one a larger batch runs out of memory in; not necessarily the fastest-growing one).

    ``weights_bytes``, ``gradient_bytes`` and ``optimizer_state_bytes`` are measured directly
    (parameter storages, the gradients and optimizer state the probe's step allocated), so a
    reader can see what the fixed part is made of.

    ``unit`` says which memory the lines count: a result's equation counts what its budget
    counts (reserved bytes on CUDA, where the limit caps the allocator's segments), because it
    is the one that predicts the boundary and sizes the safe batch. Fit the other unit from the
    trials with ``MemoryModel.fit(result.trials, unit="allocated")``.
    """

    fixed_bytes: int
    per_sample_bytes: FittedBytes
    phase: PhaseName
    lines: tuple[PhaseLine, ...]
    weights_bytes: Bytes = 0
    gradient_bytes: Bytes = 0
    optimizer_state_bytes: Bytes = 0
    unit: Unit = "allocated"

    def predict(self, batch_size: float) -> int:
        """Predicted peak bytes at ``batch_size``."""
        return round(max(line.predict(batch_size) for line in self.lines))

    def largest_batch_within(self, budget_bytes: float, ceiling: int) -> int:
        """The largest batch in ``[0, ceiling]`` whose predicted peak stays within the budget.

        0 means not even one sample fits; ``ceiling`` bounds the answer when memory does not
        grow with the batch at all.
        """
        best = float(ceiling)
        for line in self.lines:
            if line.per_sample_bytes <= 0:
                if line.fixed_bytes > budget_bytes:
                    return 0
                continue
            best = min(best, (budget_bytes - line.fixed_bytes) / line.per_sample_bytes)
        return max(0, int(best + 1e-9))  # least squares leaves float dust: 29.9999999 is 30

    @classmethod
    def fit(
        cls,
        trials: Iterable[Trial],
        weights_bytes: int = 0,
        gradient_bytes: int = 0,
        optimizer_state_bytes: int = 0,
        unit: Unit = "allocated",
    ) -> MemoryModel | None:
        """The lines of the fitting trials' per-phase peaks (see the class); ``None`` with < 2 sizes."""
        points: dict[str, dict[int, int]] = {}
        for trial in trials:
            if not trial.fits:
                continue
            for phase, peak in trial.phase_peaks_in(unit):
                points.setdefault(phase, {})[trial.batch_size] = peak
        fitted = {phase: sorted(by_size.items()) for phase, by_size in points.items() if len(by_size) >= 2}
        if not fitted:
            return None
        largest = max(series[-1][0] for series in fitted.values())
        per_phase = [_phase_lines(phase, series) for phase, series in fitted.items()]
        main = max((lines[0] for lines in per_phase), key=lambda line: line.predict(largest))
        return cls(
            fixed_bytes=round(main.fixed_bytes),
            per_sample_bytes=main.per_sample_bytes,
            phase=main.phase,
            lines=tuple(line for lines in per_phase for line in lines),
            weights_bytes=weights_bytes,
            gradient_bytes=gradient_bytes,
            optimizer_state_bytes=optimizer_state_bytes,
            unit=unit,
        )


#: A peak within this fraction of a line lies on it (the CPU meter and CUDA's allocated bytes
#: are exact to the byte; this leaves room for a few bytes of bookkeeping that vary).
ON_LINE = 0.002
#: An upper piece's slope must be pinned to within this fraction by its span (see _phase_lines).
SLOPE_PRECISION = 0.25


def _phase_lines(phase: str, points: Sequence[tuple[int, int]]) -> tuple[PhaseLine, ...]:
    """One phase's lines: that of its upper piece first, then the chords below it (see
    [`MemoryModel`][batchfit.MemoryModel]). ``points`` are ``(size, peak)`` pairs sorted by size, at least two."""
    quantum = math.gcd(*(peak for _, peak in points))

    def within(line: PhaseLine, size: int, peak: int) -> bool:
        return abs(line.predict(size) - peak) <= max(ON_LINE * peak, quantum)

    def determined(line: PhaseLine, run: Sequence[tuple[int, int]]) -> bool:
        # Peaks known to within the tolerance pin the slope to within 2 x tolerance / span: a
        # run of neighbouring sizes at the boundary (1376..1379) under CUDA's 2-20 MiB segments
        # fits any slope from 0 to 4 MiB/sample, so it is no upper piece until it is longer.
        span = run[-1][0] - run[0][0]
        tolerance = max(ON_LINE * run[-1][1], quantum)
        return 2 * tolerance <= SLOPE_PRECISION * line.per_sample_bytes * span

    upper: tuple[int, PhaseLine] | None = None
    for start in range(len(points) - 2, -1, -1):  # the run points[start:], longer each time
        run = points[start:]
        line = _least_squares(phase, run)
        if line.per_sample_bytes > 0 and all(within(line, size, peak) for size, peak in run):
            if determined(line, run):
                upper = start, line
        elif upper is not None:
            break
    if upper is None:  # nothing grows (a flat phase): the line through every size
        return (_least_squares(phase, points),)
    start, line = upper
    chords = []
    for (x0, y0), (x1, y1) in zip(points[:start], points[1 : start + 1]):
        slope = (y1 - y0) / (x1 - x0)
        chord = PhaseLine(phase, y0 - slope * x0, slope)
        if slope >= 0 and chord not in chords and all(chord.predict(x) <= y or within(chord, x, y) for x, y in points):
            chords.append(chord)
    return (line, *chords)


def _least_squares(phase: str, points: Sequence[tuple[int, int]]) -> PhaseLine:
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    slope = sxy / sxx if sxx else 0.0
    return PhaseLine(phase, mean_y - slope * mean_x, slope)
