"""What a probe returns: frozen dataclasses, the fitted memory equation, JSON round trip.

Pure Python (no torch import): a result can be loaded and read on a machine without torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from functools import cache
from types import UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from batchfit.search import StopReason
from batchfit.units import format_bytes

SCHEMA = "batchfit.result/1"
PHASES = ("batch", "forward", "backward", "step")

#: Where a step was when it ran out of memory, and the phases peaks are recorded for.
Phase = Literal["batch", "forward", "backward", "step"]
#: Why a trial ran: the search, the safe batch's verification, or the CI gate's one trial.
TrialKind = Literal["search", "verify", "gate"]
#: Which memory a budget, a peak or a memory equation counts: what live tensors hold
#: (``"allocated"``), or what the allocator holds from the device (``"reserved"``, the unit of
#: a CUDA limit).
Unit = Literal["allocated", "reserved"]

_Record = TypeVar("_Record")


@dataclass(frozen=True)
class Trial:
    """One batch size, run for real.

    Attributes:
        batch_size: the size tried.
        fits: every step completed without running out of memory.
        kind: ``"search"`` for the search's trials, ``"verify"`` for the extra steps that
            check the safe batch.
        phase: where it ran out of memory (``"batch"``, ``"forward"``, ``"backward"``,
            ``"step"``), ``None`` when it fitted.
        peak_bytes: peak allocated memory (live tensors) of the trial. For a failed trial: a
            lower bound of what the size needs (on the CPU the live bytes plus the failing
            request; on CUDA the live bytes when it failed), else ``None``.
        phase_peaks: peak allocated memory per phase, as ``(phase, bytes)`` pairs.
        reserved_peak_bytes: the same in reserved bytes (what the allocator held from the
            device; on CUDA a memory limit counts these). Equal to ``peak_bytes`` on the CPU. For
            a failed CUDA trial: reserved bytes plus the segment the allocator was refused.
        phase_reserved_peaks: peak reserved memory per phase.
        step_time_s: median wall time of the timed steps (steps 2..N; a one-step trial times its
            only step), ``None`` if none ran.
        step_times_s: the wall time of every timed step, in order (their spread is the noise).
        samples_per_s: ``batch_size / step_time_s``; across ranks the whole group's,
            ``world_size * batch_size / step_time_s`` with the slowest rank's step time.
        steps: steps that completed.
        leaked_bytes: memory still allocated after the trial was released (0 is healthy).
        message: first line of the out-of-memory error, for failed trials.
        skipped_steps: steps whose optimizer update a ``GradScaler`` skipped (fp16 gradients
            overflowed). They ran on top of ``steps``: a trial only counts real optimizer steps,
            because the optimizer state is allocated in the first one.
    """

    batch_size: int
    fits: bool
    kind: TrialKind = "search"
    phase: Phase | None = None
    peak_bytes: int | None = None
    phase_peaks: tuple[tuple[str, int], ...] = ()
    step_time_s: float | None = None
    samples_per_s: float | None = None
    steps: int = 0
    leaked_bytes: int = 0
    message: str | None = None
    reserved_peak_bytes: int | None = None
    phase_reserved_peaks: tuple[tuple[str, int], ...] = ()
    skipped_steps: int = 0
    step_times_s: tuple[float, ...] = ()

    @property
    def peaks_by_phase(self) -> dict[str, int]:
        return dict(self.phase_peaks)

    @property
    def capped_peak_bytes(self) -> int | None:
        """The peak a memory limit is compared with: reserved bytes where they were recorded (a
        CUDA limit caps them; on the CPU they equal the live-tensor bytes), else allocated."""
        return self.reserved_peak_bytes if self.reserved_peak_bytes is not None else self.peak_bytes

    def peak_in(self, unit: Unit) -> int | None:
        """The peak counted in ``unit``."""
        return self.reserved_peak_bytes if unit == "reserved" else self.peak_bytes

    def phase_peaks_in(self, unit: Unit) -> tuple[tuple[str, int], ...]:
        """The per-phase peaks counted in ``unit``."""
        return self.phase_reserved_peaks if unit == "reserved" else self.phase_peaks

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trial:
        """The inverse of ``dataclasses.asdict(trial)`` (JSON turns the pairs into lists).

        Raises ``ValueError`` naming the field when ``data`` is not a trial (see
        :meth:`Result.from_dict`).
        """
        return _read_document(cls, data, "trial")


@dataclass(frozen=True)
class PhaseLine:
    """``peak(b) = fixed_bytes + per_sample_bytes * b`` for one phase of the step."""

    phase: str
    fixed_bytes: float
    per_sample_bytes: float

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
    per_sample_bytes: float
    phase: str
    lines: tuple[PhaseLine, ...]
    weights_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_state_bytes: int = 0
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


def _phase_lines(phase: str, points: Sequence[tuple[int, int]]) -> tuple[PhaseLine, ...]:
    """One phase's lines: that of its upper piece first, then the chords below it (see
    :class:`MemoryModel`). ``points`` are ``(size, peak)`` pairs sorted by size, at least two."""
    quantum = math.gcd(*(peak for _, peak in points))

    def within(line: PhaseLine, size: int, peak: int) -> bool:
        return abs(line.predict(size) - peak) <= max(ON_LINE * peak, quantum)

    upper: tuple[int, PhaseLine] | None = None
    for start in range(len(points) - 2, -1, -1):  # the run points[start:], longer each time
        line = _least_squares(phase, points[start:])
        if line.per_sample_bytes > 0 and all(within(line, size, peak) for size, peak in points[start:]):
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


@dataclass(frozen=True)
class DeviceInfo:
    """The device the probe ran on.

    ``total_bytes`` is the total that memory fractions and budgets refer to: on CUDA the
    runtime's ``totalGlobalMem`` (what ``set_per_process_memory_fraction`` multiplies).
    ``nvml_total_bytes`` is NVML's (``nvidia-smi``'s) total, which also counts memory the driver
    reserves (about 0.5 GiB more); shown beside it, never used for arithmetic. ``config``: the
    settings that change what a step allocates or how fast it runs (allocator backend,
    ``PYTORCH_CUDA_ALLOC_CONF``, TF32, ``cudnn.benchmark``; torch threads on the CPU).
    """

    type: str
    index: int | None = None
    name: str = ""
    total_bytes: int | None = None
    nvml_total_bytes: int | None = None
    config: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceInfo:
        """The inverse of ``dataclasses.asdict(info)``; ``ValueError`` naming the field when
        ``data`` is not a device description."""
        return _read_document(cls, data, "device")


@dataclass(frozen=True)
class Settings:
    """The options the probe ran with, as resolved (limits in bytes)."""

    mode: str = "train"
    amp: str | None = None
    init_batch: int = 2
    max_batch: int = 32768
    multiple_of: int = 1
    steps_per_trial: int | None = None
    verify_steps: int = 3
    headroom: float = 0.10
    strategy: str = "interpolate"
    memory_limit_bytes: int | None = None
    limit_source: str = "device"
    time_budget_s: float | None = None
    reserve_bytes: int = 0


#: The knee is the smallest timed size whose samples/s reach this fraction of the best.
KNEE_FRACTION = 0.95


def best_timed(trials: Sequence[Trial]) -> dict[int, Trial]:
    """Each size's best-timed fitting trial: the one with the most timed steps (the first on a
    tie). A one-step search trial's rate is noisier than the verification's, so it must not
    outvote it."""
    timed: dict[int, Trial] = {}
    for trial in trials:
        if not trial.fits or not trial.samples_per_s:
            continue
        known = timed.get(trial.batch_size)
        if known is None or len(trial.step_times_s) > len(known.step_times_s):
            timed[trial.batch_size] = trial
    return timed


@dataclass(frozen=True)
class Throughput:
    """What the timed steps say about speed, and how far to trust it.

    Each size's rate is ``batch_size / median step time`` of its best-timed trial (the one with
    the most timed steps: the verification at the safe batch times two steps after the step that
    allocates the optimizer state; a one-step search trial times its only step, which on a GPU
    also pays for the first use of that shape).

    Attributes:
        best_batch, best_samples_per_s: the size with the highest rate.
        knee_batch, knee_samples_per_s: the smallest size within 5% of the best rate
            (:data:`KNEE_FRACTION`): past it, bigger batches stop paying in throughput.
        spread: the relative spread of repeated step times, ``(slowest - fastest) / median``,
            the largest over the sizes timed more than once (``None``: no size was). Rates that
            differ by less than this are not told apart by the measurement.
        within_noise: the best rate exceeds the knee's by less than ``spread``: "best" is then
            one measurement's luck as much as a real difference.
        single_step_best: the best rate comes from a single timed step.
    """

    best_batch: int
    best_samples_per_s: float
    knee_batch: int
    knee_samples_per_s: float
    spread: float | None = None
    within_noise: bool = False
    single_step_best: bool = False

    @classmethod
    def of(cls, trials: Sequence[Trial]) -> Throughput | None:
        """The throughput answer of ``trials`` (``None`` when no fitting trial was timed)."""
        timed = best_timed(trials)
        if not timed:
            return None
        rates = {size: trial.samples_per_s or 0.0 for size, trial in timed.items()}
        best = max(rates, key=lambda size: rates[size])
        knee = min(size for size, rate in rates.items() if rate >= KNEE_FRACTION * rates[best])
        spreads = [
            (max(t.step_times_s) - min(t.step_times_s)) / t.step_time_s
            for t in timed.values()
            if len(t.step_times_s) >= 2 and t.step_time_s
        ]
        spread = max(spreads) if spreads else None
        return cls(
            best_batch=best,
            best_samples_per_s=rates[best],
            knee_batch=knee,
            knee_samples_per_s=rates[knee],
            spread=spread,
            within_noise=spread is not None and knee != best and rates[best] - rates[knee] < spread * rates[knee],
            single_step_best=len(timed[best].step_times_s) < 2,
        )


@dataclass(frozen=True)
class Result:
    """The answer of :func:`batchfit.find`.

    Attributes:
        max_batch: the largest batch size that trained (the exact boundary when
            ``boundary_reached``).
        safe_batch: a size whose predicted peak leaves ``settings.headroom`` of the budget free,
            checked with ``settings.verify_steps`` extra steps (``safe_verified``).
        best_throughput_batch: the fitting size with the most samples/s (see ``throughput``
            for the knee and how much of the difference is noise).
        budget_bytes: the memory the probe was allowed to use.
        boundary_reached: a size failed right above ``max_batch``; ``False`` means the search
            hit ``max_batch`` or the time budget first.
        stop_reason: ``"boundary"``, ``"max_batch"`` or ``"stopped"``.
        non_monotone: some size failed although a larger one fitted.
        trials: every trial, in order.
        memory: the fitted memory equation, ``None`` with fewer than two fitting sizes.
        notes: warnings worth reading (leaked memory, non-monotone memory, ...).
        budget_counts: the memory the budget counts, ``"allocated"`` (live tensors; the CPU) or
            ``"reserved"`` (the allocator's segments; CUDA). The search aims, and the safe batch
            keeps its headroom, in this unit.
        world_size: the ranks that probed together (``torchrun``, DDP); batch sizes are per
            rank, peaks the largest rank's, throughput the whole group's. 1 for one process.
        estimated: the answer of :func:`batchfit.estimate` (fake tensors, no device), not of
            real steps; ``assumptions`` says what it rests on.
    """

    max_batch: int
    safe_batch: int
    best_throughput_batch: int
    budget_bytes: int | None
    boundary_reached: bool
    stop_reason: StopReason
    non_monotone: bool
    safe_verified: bool
    trials: tuple[Trial, ...]
    memory: MemoryModel | None
    device: DeviceInfo
    settings: Settings
    elapsed_s: float
    torch_version: str
    batchfit_version: str
    notes: tuple[str, ...] = field(default=())
    budget_counts: Unit = "allocated"
    throughput: Throughput | None = None
    world_size: int = 1
    estimated: bool = False
    assumptions: tuple[str, ...] = field(default=())

    @property
    def global_max_batch(self) -> int:
        """``max_batch`` over every rank: ``world_size * max_batch``."""
        return self.world_size * self.max_batch

    @property
    def global_safe_batch(self) -> int:
        """``safe_batch`` over every rank: ``world_size * safe_batch``."""
        return self.world_size * self.safe_batch

    @property
    def search_trials(self) -> tuple[Trial, ...]:
        return tuple(t for t in self.trials if t.kind == "search")

    def trial(self, batch_size: int) -> Trial | None:
        """The last search trial at ``batch_size``, if any."""
        found = [t for t in self.search_trials if t.batch_size == batch_size]
        return found[-1] if found else None

    # JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = SCHEMA
        return data

    def to_json(self, indent: int | None = 2) -> str:
        """A stable JSON document (schema ``batchfit.result/1``)."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        """The inverse of :meth:`to_dict`.

        Every field is checked against its type: ints are ints (not bools, floats or strings),
        numbers finite, names within their allowed values, nested records likewise; fields
        with a default may be absent (documents written before they existed), others may not,
        and unknown fields are refused. Anything else raises one ``ValueError`` that says what
        is wrong and where, e.g. ``not a batchfit result: field 'trials[2].peak_bytes' must be
        an int or null, got str '17'``.
        """
        if isinstance(data, dict) and data.get("schema") != SCHEMA:
            raise ValueError(f"not a batchfit result: schema is {data.get('schema')!r}, expected {SCHEMA!r}")
        if isinstance(data, dict):
            data = {name: value for name, value in data.items() if name != "schema"}
        return _read_document(cls, data, "result")

    @classmethod
    def from_json(cls, text: str | bytes) -> Result:
        """The inverse of :meth:`to_json`; ``ValueError`` for anything else (see :meth:`from_dict`)."""
        try:
            data = json.loads(text)
        except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
            raise ValueError(f"not a batchfit result: invalid JSON ({error})") from None
        return cls.from_dict(data)

    # Text -----------------------------------------------------------------------------------
    def __str__(self) -> str:
        return render_text(self)


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def render_text(result: Result) -> str:
    """A plain-text summary: headline numbers, the memory equation, one row per trial."""
    device = result.device
    lines = [
        *(
            ["ESTIMATE: no step ran on a device (batchfit.estimate); see the assumptions below"]
            if result.estimated
            else []
        ),
        f"batchfit {result.batchfit_version} on {device.name or device.type}"
        f" (torch {result.torch_version}, {result.settings.mode}"
        f"{', amp ' + result.settings.amp if result.settings.amp else ''})",
        f"memory budget      {format_bytes(result.budget_bytes)} ({result.settings.limit_source}"
        + ("; counts reserved bytes)" if result.budget_counts == "reserved" else ")"),
        f"max batch          {result.max_batch}"
        + ("" if result.boundary_reached else f"  (boundary not reached: {result.stop_reason})"),
        f"safe batch         {result.safe_batch}  ({result.settings.headroom:.0%} headroom, "
        + (("checked on fake steps" if result.estimated else "verified") if result.safe_verified else "NOT verified")
        + ")",
        f"best throughput    {'not measured (estimate)' if result.estimated else result.best_throughput_batch}",
    ]
    if result.world_size > 1:
        lines.append(
            f"ranks              {result.world_size}: batch sizes per rank; "
            f"global max batch {result.global_max_batch}, global safe batch {result.global_safe_batch}"
        )
    if result.throughput is not None:
        lines.append(f"throughput knee    {result.throughput.knee_batch}")
    if result.memory is not None:
        mem = result.memory
        lines.append(
            f"memory equation    {format_bytes(mem.fixed_bytes)} + "
            f"{format_bytes(mem.per_sample_bytes)} x batch  ({mem.phase} peak, {mem.unit}; weights "
            f"{format_bytes(mem.weights_bytes)}, grads {format_bytes(mem.gradient_bytes)}, "
            f"optimizer state {format_bytes(mem.optimizer_state_bytes)})"
        )
    lines.append(f"trials             {len(result.trials)} in {result.elapsed_s:.1f} s")
    lines.append("")
    lines.append(f"{'batch':>8}  {'kind':<6}  {'outcome':<14}  {'peak':>12}  {'step':>10}  {'samples/s':>11}")
    for trial in result.trials:
        outcome = "fits" if trial.fits else f"OOM ({trial.phase})"
        step = "-" if trial.step_time_s is None else _duration(trial.step_time_s)
        rate = f"{trial.samples_per_s:,.1f}" if trial.samples_per_s is not None else "-"
        peak = format_bytes(trial.peak_in(result.budget_counts))
        if not trial.fits and trial.peak_in(result.budget_counts) is not None:
            peak = ">=" + peak  # what was held when it failed: a lower bound of what the size needs
        lines.append(f"{trial.batch_size:>8}  {trial.kind:<6}  {outcome:<14}  {peak:>12}  {step:>10}  {rate:>11}")
    for note in result.notes:
        lines.append(f"note: {note}")
    for assumption in result.assumptions:
        lines.append(f"assumes: {assumption}")
    return "\n".join(lines)


# Reading documents back --------------------------------------------------------------------------
class _Corrupt(Exception):
    """What is wrong with a document, and where (raised inside, turned into one ValueError)."""


def _read_document(cls: type[_Record], data: Any, noun: str) -> _Record:
    try:
        return _read_record(cls, data, "")
    except _Corrupt as corrupt:
        raise ValueError(f"not a batchfit {noun}: {corrupt}") from None


def _read_record(cls: type[_Record], data: Any, path: str) -> _Record:
    """``cls`` from the mapping ``data``, every field checked against its type hint."""
    if not isinstance(data, dict):
        if not path:
            raise _Corrupt(f"the document is {_kind(data)}, not an object")
        raise _Corrupt(f"field {path!r} must be an object, got {_shown(data)}")
    declared = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    for name in data:
        if name not in declared:
            raise _Corrupt(f"unknown field {_joined(path, str(name))!r}")
    for name, declaration in declared.items():
        if name not in data and declaration.default is MISSING and declaration.default_factory is MISSING:
            raise _Corrupt(f"missing field {_joined(path, name)!r}")
    hints = _hints(cls)
    return cls(**{name: _read_value(hints[name], value, _joined(path, name)) for name, value in data.items()})


def _read_value(hint: Any, value: Any, path: str, nullable: bool = False) -> Any:
    """``value`` as the type ``hint`` describes (JSON lists become tuples), or ``_Corrupt``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = (arg for arg in args if arg is not type(None))
        return _read_value(inner, value, path, nullable=type(None) in args)
    if is_dataclass(hint):
        if nullable and not isinstance(value, dict):
            raise _Corrupt(f"field {path!r} must be an object or null, got {_shown(value)}")
        return _read_record(hint, value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Corrupt(f"field {path!r} must be a list{' or null' if nullable else ''}, got {_shown(value)}")
        items = args[:1] * len(value) if args[1:] == (Ellipsis,) else args
        if len(items) != len(value):
            raise _Corrupt(f"field {path!r} must be a list of {len(items)} items, got {_shown(value)}")
        return tuple(_read_value(item, v, f"{path}[{i}]") for i, (item, v) in enumerate(zip(items, value)))
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        allowed = ", ".join(repr(arg) for arg in args) + (" or null" if nullable else "")
        raise _Corrupt(f"field {path!r} must be one of {allowed}, got {_shown(value)}")
    wanted, accepted = _SCALARS[hint]
    if not accepted(value):
        raise _Corrupt(f"field {path!r} must be {wanted}{' or null' if nullable else ''}, got {_shown(value)}")
    return float(value) if hint is float else value


#: What each scalar type hint accepts: a description for the message, and the test. Bools are
#: ints in Python, but never in a document; ints are accepted where a float is expected.
_SCALARS: dict[Any, tuple[str, Callable[[Any], bool]]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("an int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a finite number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _finite(number: float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int beyond any float
        return False


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _joined(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    """A JSON-ish name of ``value``'s type, with its article."""
    if value is None:
        return "null"
    names = {bool: "a bool", int: "an int", float: "a float", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), f"a {type(value).__name__}")


def _shown(value: Any) -> str:
    """``str '17'``, ``float nan``, ``null``: the type and (the start of) the value."""
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
